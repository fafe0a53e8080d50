"""Worker functions for tests/test_bad_input_regressions.py: one per way issue 40 found
the bad-input guarantee broken, each on every rank of a gloo group (2 or 4 ranks).

Every scenario steps a small DMuon through a faulty step ``k`` and the step ``k + 1``
after it (clean grads), and returns, for this rank, what each step raised and whether
everything (parameters, state keys and values, bit for bit) after ``k + 1`` equals what it
was before ``k``. The contract (docs/optimizer.md, "Behaviour on bad input"): no hang, the
same error on every rank by ``k + 1``, nothing changed by a step that raises, and the
optimizer usable after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dmuon import DMuon

SHAPES = {"w1": (8, 12), "w2": (12, 8), "norm": (12,), "emb": (10, 6), "rep": (7,)}
REPLICATED = {"rep"}  # replicated on the mesh (a sequence-parallel norm's weight): its grad may be Partial


def _error(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test reads the type and message
        return f"{type(error).__name__}: {error}"
    return None


def _bits(t: torch.Tensor) -> list[int]:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.detach().clone().reshape(-1).view(torch.uint8).tolist()


def snapshot(params: dict[str, nn.Parameter], optimizer: DMuon) -> dict:
    """This rank's bytes of every parameter and state value, and the state keys."""
    snap: dict = {name: _bits(p) for name, p in params.items()}
    for name, p in params.items():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            snap[name, key] = _bits(value) if isinstance(value, torch.Tensor) else value
    return snap


def _model(mesh: Any, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {n: nn.Parameter(distribute_tensor(torch.randn(s, generator=gen, dtype=dtype), mesh,
                                              [Replicate() if n in REPLICATED else Shard(0)], src_data_rank=None))
            for n, s in SHAPES.items()}


def _grads(params: dict[str, nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params.values():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen, dtype=p.dtype), p.device_mesh,
                                   list(p.placements), src_data_rank=None)


def _optimizer(params: dict[str, nn.Parameter], **options: Any) -> DMuon:
    return DMuon([{"params": [(n, params[n]) for n in ("w1", "w2")], "use_muon": True},
                  {"params": [(n, params[n]) for n in ("norm", "emb", "rep")], "use_muon": False}],
                 lr=0.02, weight_decay=0.1, **options)


def fault_then_report(fault: Callable[[dict[str, nn.Parameter], int, int], None], world_mesh: bool = True,
                      **options: Any) -> dict[str, Any]:
    """One clean step, the faulty step ``k`` (``fault(params, rank, world)`` spoils this
    rank's grads), the step ``k + 1`` with clean grads, then two clean steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    params = _model(mesh)
    optimizer = _optimizer(params, **options)
    _grads(params, 1)
    optimizer.step()
    before = snapshot(params, optimizer)
    _grads(params, 2)
    fault(params, rank, world)
    step_k = _error(optimizer.step)
    _grads(params, 3)
    step_k1 = _error(optimizer.step)
    unchanged = snapshot(params, optimizer) == before
    after = []
    for seed in (4, 5):
        _grads(params, seed)
        after.append(_error(optimizer.step))
    return {"k": step_k, "k+1": step_k1, "unchanged": unchanged, "after": after,
            "telemetry": None if not options.get("telemetry") else optimizer.telemetry() is not None}


# ----------------------------------------------------------------------- the faults


def local_problem_here_partial_elsewhere(params: dict[str, nn.Parameter], rank: int, world: int) -> None:
    """Item 1: a rank with a local problem (a grad of another dtype) while the others hold a
    Partial AdamW grad (which DTensor would reduce with a collective of its own)."""
    full = params["norm"].grad.full_tensor()  # a collective: every rank, before the ranks differ
    if rank == 0:
        params["emb"].grad_dtype = None
        params["emb"].grad = params["emb"].grad.to(torch.float64)
    else:
        params["norm"].grad = DTensor.from_local(full, params["norm"].device_mesh, [Partial()], run_check=False)


def partial_here_none_elsewhere(params: dict[str, nn.Parameter], rank: int, world: int) -> None:
    """Item 2: a grad placed Partial on rank 0, None on the others."""
    full = params["w1"].grad.full_tensor()  # a collective: every rank, before the ranks differ
    if rank == 0:
        params["w1"].grad = DTensor.from_local(full, params["w1"].device_mesh, [Partial()], run_check=False)
    else:
        params["w1"].grad = None


def grad_on_another_mesh(params: dict[str, nn.Parameter], rank: int, world: int) -> None:
    """Item 3: the last rank's grad lives on another mesh of the same ranks (a
    redistribute to the parameter's would raise there only, after its AdamW step)."""
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))  # every rank: a collective-free 1-D mesh
    if rank == world - 1:
        params["w2"].grad = DTensor.from_local(params["w2"].grad.to_local(), other, [Shard(0)], run_check=False)


def complex_grad_on_last_rank(params: dict[str, nn.Parameter], rank: int, world: int) -> None:
    """Item 4 (with telemetry): an invalid grad on the last rank."""
    if rank == world - 1:
        params["w1"].grad_dtype = None
        params["w1"].grad = DTensor.from_local(params["w1"].grad.to_local().to(torch.complex64),
                                               params["w1"].device_mesh, [Shard(0)], run_check=False)


def adamw_grad_missing_on_rank_0(params: dict[str, nn.Parameter], rank: int, world: int) -> None:
    """Item 7: an AdamW DTensor's grad present on some ranks only."""
    if rank == 0:
        params["emb"].grad = None


def local_shape_differs(params: dict[str, nn.Parameter], rank: int, world: int) -> None:
    """Suspected item: a grad of the right global shape but another local shape here."""
    if rank == 0:
        local = params["w1"].grad.to_local()
        params["w1"].grad = DTensor.from_local(torch.cat([local, local[:1]]), params["w1"].device_mesh, [Shard(0)],
                                               run_check=False, shape=params["w1"].shape,
                                               stride=params["w1"].grad.stride())


def adamw_dtype_differs(params: dict[str, nn.Parameter], rank: int, world: int) -> None:
    """Suspected item: an AdamW grad torch's AdamW would fail on after other groups stepped."""
    if rank == 0:
        params["norm"].grad_dtype = None
        params["norm"].grad = params["norm"].grad.to(torch.float64)


def partial_here_replicated_elsewhere(params: dict[str, nn.Parameter], rank: int, world: int) -> None:
    """A replicated parameter's grad Partial on rank 0, replicated on the others: summed by
    every rank alike, then found by the status (no sum is the grad)."""
    if rank == 0:
        grad = params["rep"].grad
        params["rep"].grad = DTensor.from_local(grad.to_local(), grad.device_mesh, [Partial()], run_check=False)


FAULTS = {
    "local_problem_here_partial_elsewhere": local_problem_here_partial_elsewhere,
    "partial_here_none_elsewhere": partial_here_none_elsewhere,
    "partial_here_replicated_elsewhere": partial_here_replicated_elsewhere,
    "grad_on_another_mesh": grad_on_another_mesh,
    "complex_grad_on_last_rank": complex_grad_on_last_rank,
    "adamw_grad_missing_on_rank_0": adamw_grad_missing_on_rank_0,
    "local_shape_differs": local_shape_differs,
    "adamw_dtype_differs": adamw_dtype_differs,
}


def every_fault(**options: Any) -> dict[str, dict[str, Any]]:
    """Each fault of :data:`FAULTS` through :func:`fault_then_report`."""
    return {name: fault_then_report(fault, **options) for name, fault in FAULTS.items()}


def partial_grads_summed_like_dtensor() -> dict[str, Any]:
    """A replicated parameter stepped twice from the same start: once with this rank's
    share of its grad as a ``Partial`` sum (DMuon sums it), once with DTensor's own sum of
    the same shares; this rank's parameter and state bytes after each."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    share = torch.randn(SHAPES["rep"], generator=torch.Generator().manual_seed(10 + rank))
    found = {}
    for how in ("partial", "dtensor_sum"):
        params = _model(mesh)
        optimizer = _optimizer(params)
        _grads(params, 1)
        partial = DTensor.from_local(share, mesh, [Partial()], run_check=False)
        params["rep"].grad = partial if how == "partial" else partial.redistribute(mesh, [Replicate()])
        optimizer.step()
        found[how] = snapshot(params, optimizer)
    return found


def every_fault_with_telemetry() -> dict[str, dict[str, Any]]:
    return every_fault(telemetry=True)


# ----------------------------------------------------------------- the other items


def two_meshes_one_problem() -> dict[str, Any]:
    """Item 5: parameters on a flat mesh and on a 2-D mesh of the same 4 ranks; an invalid
    grad on the last rank only masks every parameter of the DMuon on every rank, and the
    ranks agree on which state exists."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    gen = torch.Generator().manual_seed(0)
    params = {"a": nn.Parameter(distribute_tensor(torch.randn(8, 6, generator=gen), flat, [Shard(0)],
                                                  src_data_rank=None)),
              "b": nn.Parameter(distribute_tensor(torch.randn(8, 6, generator=gen), grid, [Replicate(), Shard(0)],
                                                  src_data_rank=None))}
    optimizer = DMuon([{"params": list(params.items()), "use_muon": True}])
    before = snapshot(params, optimizer)
    _grads(params, 1)
    if rank == world - 1:
        params["a"].grad_dtype = None
        params["a"].grad = DTensor.from_local(params["a"].grad.to_local().to(torch.complex64), flat, [Shard(0)],
                                              run_check=False)
    step_k = _error(optimizer.step)
    moved = snapshot(params, optimizer) != before
    state_keys_after_k = sorted(n for n, p in params.items() if p in optimizer.state)
    _grads(params, 2)
    step_k1 = _error(optimizer.step)
    return {"k": step_k, "k+1": step_k1, "unchanged": snapshot(params, optimizer) == before,
            "params_moved_at_k": moved and any(snapshot(params, optimizer)[n] != before[n] for n in params),
            "state_keys": sorted(n for n, p in params.items() if p in optimizer.state),
            "state_keys_after_k": state_keys_after_k}


def nan_in_a_masked_step() -> dict[str, Any]:
    """Item 6: a step masked by another rank's invalid grad, with a NaN grad and a ``-0.0``
    momentum element on a matrix: the matrix, its momentum and NorMuon rows keep their bits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    params = _model(mesh)
    optimizer = _optimizer(params, normuon=True)
    _grads(params, 1)
    optimizer.step()
    optimizer.state[params["w1"]]["momentum_buffer"].to_local().view(-1)[:1] = -0.0
    before = snapshot(params, optimizer)
    _grads(params, 2)
    params["w1"].grad.to_local().fill_(float("nan"))
    if rank == world - 1:
        params["emb"].grad_dtype = None
        params["emb"].grad = params["emb"].grad.to(torch.float64)
    step_k = _error(optimizer.step)
    same_at_k = {name: snapshot(params, optimizer)[name] == before[name] for name in ("w1",)}
    same_at_k["w1 momentum"] = snapshot(params, optimizer)["w1", "momentum_buffer"] == before["w1", "momentum_buffer"]
    same_at_k["w1 normuon"] = (snapshot(params, optimizer)["w1", "normuon_second_moment"]
                               == before["w1", "normuon_second_moment"])
    _grads(params, 3)
    step_k1 = _error(optimizer.step)
    return {"k": step_k, "k+1": step_k1, "same_at_k": same_at_k, "unchanged": snapshot(params, optimizer) == before}


def foreach_false_runs_no_list_rule() -> dict[str, int]:
    """Item 10: ``foreach=False`` runs no ``torch._foreach_*`` update rule (lerp, mul, add)
    on the DTensor Muon parameters' masked path; the exchange's own packing copies aside."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    params = _model(mesh)
    optimizer = _optimizer(params, foreach=False, fused=False)
    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            name = str(func.overloadpacket)
            if "_foreach_" in name and "copy" not in name:
                counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    for seed in (1, 2):
        _grads(params, seed)
        with Count():
            optimizer.step()
    return counts
