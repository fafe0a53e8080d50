"""DMuon's state through TorchTitan 0.3.x's flat, FQN-keyed optimizer state and DCP,
with FSDP-sharded parameters on two CPU ranks (gloo).

TorchTitan's checkpointer saves ``OptimizersContainer.state_dict()`` (keys
``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``) with DCP and loads it back
through ``load_state_dict``; both first run ``init_optim_state`` (a zero-grad, lr-0
step). Skipped unless TorchTitan 0.3.x is installed.
"""

from __future__ import annotations

import pytest

from tests.titan03_support import require_titan03

require_titan03()

from tests.multiprocess import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.multirank


def _sharded_toy(seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.titan03_support import ToyLlama3

    model = ToyLlama3(seed=seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",)))
    return model


def _local_copies(model) -> list:
    return [p.detach().to_local().clone() for p in model.parameters()]


def _train(container, model, steps: range) -> None:
    import torch

    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for param in model.parameters():  # the same full gradient on every rank, each keeps its shard
            full = torch.randn(param.shape, generator=generator)
            param.grad = torch.distributed.tensor.distribute_tensor(full, param.device_mesh, param.placements)
        container.step()
        container.zero_grad()


def _init_state_changes_nothing() -> bool:
    import torch

    from torchtitan_ext.titan03.optimizer import dmuon_optimizer

    model = _sharded_toy()
    container = dmuon_optimizer(lr=torch.tensor(0.02), weight_decay=0.1).build(model_parts=[model])
    before = _local_copies(model)
    container.state_dict()  # init_optim_state
    return all(torch.equal(a, b) for a, b in zip(before, _local_copies(model)))


def _dcp_round_trip(folder: str) -> bool:
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_ext.titan03.optimizer import dmuon_optimizer

    def fresh():
        model = _sharded_toy()
        return model, dmuon_optimizer(weight_decay=0.1).build(model_parts=[model])

    model_a, container_a = fresh()
    _train(container_a, model_a, range(2))
    dcp.save({"model": model_a.state_dict(), "optimizer": container_a.state_dict()}, checkpoint_id=folder)
    model_b, container_b = fresh()
    # As TorchTitan's checkpointer: the flat dict's tensors are the live state (made by
    # init_optim_state), DCP loads into them, then load_state_dict takes the rest.
    loaded = {"model": model_b.state_dict(), "optimizer": container_b.state_dict()}
    dcp.load(loaded, checkpoint_id=folder)
    model_b.load_state_dict(loaded["model"])
    container_b.load_state_dict(loaded["optimizer"])
    _train(container_a, model_a, range(2, 4))
    _train(container_b, model_b, range(2, 4))
    return all(torch.equal(a, b) for a, b in zip(_local_copies(model_a), _local_copies(model_b)))


def test_init_optim_state_leaves_fsdp_shards_bit_for_bit_unchanged():
    assert run_on_ranks(_init_state_changes_nothing, 2) == [True, True]


def test_a_dcp_round_trip_of_the_flat_state_continues_exactly(tmp_path):
    assert run_on_ranks(_dcp_round_trip, 2, str(tmp_path / "checkpoint")) == [True, True]
