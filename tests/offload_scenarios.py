"""Worker functions for the CPU-offload tests (run by tests/multiprocess.py).

Under FSDP2's CPU offload a GPU run keeps parameters, grads and state on the host and
stages the exchange through host buffers (``dmuon.exchange.host_staging``). Without a
GPU, ``host_staging.FORCE`` runs that same code on a CPU mesh: each worker steps one
model twice on a gloo group, directly and staged, and reports whether every local
parameter and state tensor came out bitwise equal, and the waits the staged run
announced in its last step.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dmuon import DMuon
from dmuon.exchange import host_staging
from tests import qk_clip_scenarios as qk
from tests.distributed_scenarios import CASES, GROUP_OPTIONS, STEPS, device_type

# One row on two ranks: rank 0 holds the matrix whole and keeps it (a unit that never travels,
# like each expert of the 3-D weight, whole on its rank).
OFFLOAD_CASES = [*CASES, ("one_row", (1, 16), "muon_a")]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape, _ in OFFLOAD_CASES}


def _groups(params: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [{"params": [(n, params[n]) for n, _, g in OFFLOAD_CASES if g == group], **options}
            for group, options in GROUP_OPTIONS.items()]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _snapshot(optimizer: DMuon) -> dict[str, torch.Tensor]:
    """Every parameter's local tensor and every state tensor's, by name."""
    out = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = optimizer.param_name(param)
            out[name] = _local(param)
            out.update({f"{name}.{key}": _local(value) for key, value in optimizer.state[param].items()})
    return out


def _staged_and_direct(run) -> dict[str, Any]:  # noqa: ANN001 - run(waits) -> (optimizer, snapshot)
    """``run`` direct, then staged; which tensors are bitwise equal, the staged step's waits
    by kind, and how many batches of the plan send this rank results."""
    _, direct = run([])
    waits: list[str] = []
    host_staging.FORCE = True
    try:
        optimizer, staged = run(waits)
    finally:
        host_staging.FORCE = False
    equal = {n: direct[n].dtype == staged[n].dtype and torch.equal(direct[n], staged[n]) for n in direct}
    fast = optimizer.phases.fast_path.owner_run  # the plan whose waits are counted
    batches = [] if fast is None else fast.plan.batches
    return {"equal": equal, "names": sorted(staged), "waits": dict(Counter(waits)),
            "batches_received": sum(bool(fast.layout(b).scatter_recv_units) for b in batches),
            "kept": sum(len(fast.plan.kept_local(b, fast.rank)) for b in batches)}


def fast_path(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The exactness cases plus a kept unit on Shard(0) over every rank, with DMuon ``options``."""
    mesh = init_device_mesh(device_type(), (torch.distributed.get_world_size(),))

    def shard(t: torch.Tensor) -> DTensor:
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    def run(waits: list[str]) -> tuple[DMuon, dict[str, torch.Tensor]]:
        params = {n: nn.Parameter(shard(t)) for n, t in _tensors(0).items()}
        optimizer = DMuon(_groups(params), weight_decay=0.01, foreach=True, **(options or {}))
        for step in range(STEPS):
            for name, grad in _tensors(100 + step).items():
                params[name].grad = shard(grad)
            waits.clear()
            with host_staging.listening(waits.append):
                optimizer.step()
        return optimizer, _snapshot(optimizer)

    return _staged_and_direct(run)


def qk_clip() -> dict[str, Any]:
    """QK-clip's two attentions (tests/qk_clip_scenarios.py) on Shard(0), clipping every step."""
    mesh = init_device_mesh(device_type(), (torch.distributed.get_world_size(),))

    def run(waits: list[str]) -> tuple[DMuon, dict[str, torch.Tensor]]:
        weights = {n: nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for n, w in qk.initial_weights().items()}
        optimizer = qk.make_optimizer(weights)
        for step in range(STEPS):
            x, grads = qk._step_data(step)  # noqa: SLF001 - the scenario's own data
            qk.report_logits(optimizer, weights, x, range(x.shape[0]))
            for name, grad in grads.items():
                weights[name].grad = distribute_tensor(grad, mesh, [Shard(0)])
            waits.clear()
            with host_staging.listening(waits.append):
                optimizer.step()
        return optimizer, _snapshot(optimizer)

    return _staged_and_direct(run)

