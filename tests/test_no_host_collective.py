"""The grads' status travels on the device: missing, disagreeing and invalid grads end
alike on every rank with no host agreement and no process group made by DMuon in any
step after the first. (On gloo the mesh's device is the CPU; what this checks is that
DMuon makes no group of its own and runs no collective outside its plan's; the dry run
counts collectives on CPU tensors under a CUDA-only default group:
tests/test_dry_run_host_costs.py.)

Groups are counted where torch makes every one of them
(``distributed_c10d._new_process_group_helper``: ``new_group``, ``DeviceMesh._flatten``
and ``init_device_mesh`` all end there), on a pipeline stage's 2-D mesh of a subset of the
ranks: its status needs a group of just those ranks, which DMuon gets by flattening the
mesh at planning (the first step); a step that made it again, or made any other, is
counted. The counter is shown to see ``_flatten``'s path before it is trusted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dmuon import DMuon
from tests.distributed_scenarios import _error
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

PLACEMENTS = (Replicate(), Shard(0))


def stage_steps_counting_groups() -> dict[str, Any]:
    """Two pipeline stages (ranks 0-1, 2-3), each a DMuon on its own (1 x 2) mesh: a clean
    first step (planning), then a grad missing on one rank, an invalid grad on one rank, and
    the steps that raise for them; the groups torch made in each phase."""
    made = {"count": 0}
    real = distributed_c10d._new_process_group_helper

    def counting(*args: Any, **kwargs: Any) -> Any:
        made["count"] += 1
        return real(*args, **kwargs)

    distributed_c10d._new_process_group_helper = counting
    try:
        rank = dist.get_rank()
        root = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        mesh = root["dp_replicate", "dp_shard"]
        before = made["count"]
        mesh._flatten("probe_flat")  # the path DMuon's rank set takes, under another name
        out: dict[str, Any] = {"probe": made["count"] - before}

        def shard(t: torch.Tensor) -> DTensor:
            return distribute_tensor(t, mesh, list(PLACEMENTS), src_data_rank=None)

        w = nn.Parameter(shard(torch.randn(10, 6)))
        b = nn.Parameter(shard(torch.randn(7)))
        optimizer = DMuon([{"params": [("w", w)], "use_muon": True}, {"params": [("b", b)], "use_muon": False}])

        def grads(seed: int) -> None:
            generator = torch.Generator().manual_seed(seed)
            w.grad, b.grad = shard(torch.randn(10, 6, generator=generator)), shard(torch.randn(7, generator=generator))

        before = made["count"]
        grads(0)
        optimizer.step()
        out["first_step"] = made["count"] - before
        before = made["count"]
        outcomes = []
        grads(1)
        if rank % 2 == 0:
            w.grad = None  # on one rank of each stage
        outcomes.append(_error(optimizer.step))
        grads(2)
        outcomes.append(_error(optimizer.step))
        grads(3)
        if rank == 3:
            w.grad_dtype = None
            w.grad = DTensor.from_local(w.grad.to_local().to(torch.complex64), mesh, list(PLACEMENTS), run_check=False)
        outcomes.append(_error(optimizer.step))
        grads(4)
        outcomes.append(_error(optimizer.step))
        grads(5)
        outcomes.append(_error(optimizer.step))
        out["later_steps"] = made["count"] - before
        out["outcomes"] = outcomes
        return out
    finally:
        distributed_c10d._new_process_group_helper = real


def test_missing_and_invalid_grads_make_no_process_group_and_end_alike_on_every_rank():
    ranks = run_on_ranks(stage_steps_counting_groups, 4, timeout=120)
    for rank in ranks:
        assert rank["probe"] >= 1, "the counter does not see DeviceMesh._flatten's groups"
        assert rank["later_steps"] == 0
        disagree, disagree_error, _, _, after = rank["outcomes"]
        assert disagree is None
        assert disagree_error.startswith("RuntimeError: DMuon: ranks disagree")
        assert after is None
    # The invalid grad is stage 1's (rank 3): its DMuon raises; stage 0's never sees it.
    assert ranks[3]["outcomes"][2] == "ValueError: DMuon: parameter 'w': complex gradients are not supported by Muon"
    assert [r["outcomes"][2] for r in ranks[:3]] == [None, None, None]
    assert [r["outcomes"][3] for r in ranks[:2]] == [None, None]
    for rank in ranks[2:]:
        assert rank["outcomes"][3].startswith("ValueError: DMuon: 1 rank(s) found an invalid gradient")
