"""The fault sweep's model: a handful of tiny parameters on a case's layout, their grads
step by step, and the fault injected into them (``tests.fault_cases`` names the fields).

Each parameter has a full tensor drawn from a seed of its name; a rank's DTensor is
DTensor's own block of it (``distribute_tensor(..., src_data_rank=None)``: no collective),
so the one-process reference (``full=True``: plain full tensors) starts from the same
bits, and every step's grad is the same full tensor cut the same way. A value fault (NaN,
inf) is written into that full tensor, at the first element of each faulty rank's block,
so every rank and the reference agree on what the grad is; a structural fault (sparse,
complex, a wrong shape or placement, another mesh, another dtype, None) replaces the
grad object on the faulty ranks only.

Meshes are made once per launch (:func:`meshes`): every case of a layout reuses them,
so a case makes no process group.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dmuon import AttentionHeads, DMuon
from tests.fault_cases import ROW_TARGETS, Case

# name -> (shape, group). Rows are chosen so that 4 ranks give uneven and empty shards.
PARAMS: dict[str, tuple[tuple[int, ...], str]] = {
    "w": ((10, 8), "muon"),
    "experts": ((3, 6, 4), "muon"),
    "pw": ((6, 4), "muon"),  # a plain tensor
    "nm": ((8, 6), "normuon"),
    "norm": ((12,), "adamw"),
    # An embedding-like AdamW matrix: its moments kept in the case's adamw_state_dtype (int8: a
    # whole block and a short one a row, whole rows on every rank of the Shard(0) layouts).
    "emb": ((6, 130), "adamw"),
    "rn": ((9,), "adamw"),  # replicated on every dim of its mesh: its grad may be Partial
    "pb": ((5,), "adamw"),  # a plain tensor
}
PLAIN = frozenset({"pw", "pb"})
REPLICATED = frozenset({"rn"})
HEADS = AttentionHeads(2, 2, 4)
ATTENTIONS = ("attn_a", "attn_b")
QK_PARAMS = {f"{a}.{w}": ((8, 8), "muon") for a in ATTENTIONS for w in ("wq", "wk")}
QK_THRESHOLD = 5.0
# Under two_meshes these live on the grid's row (a 1-D sub-mesh), the others on the whole grid.
ROW_PARAMS = ROW_TARGETS


def meshes(layout: str, world: int, _cache: dict = {}) -> dict[str, Any]:  # noqa: B006 - one per launch
    """The layout's meshes, made once per launch (every rank, same order): ``main`` and
    ``row`` with their placements, and ``other`` (the world's ranks reversed: a grad there
    is on another mesh)."""
    key = (layout, world)
    if key not in _cache:
        if layout == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
            found = {"main": (mesh, (Shard(0),)), "row": (mesh, (Shard(0),))}
        elif layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            found = {"main": (mesh, (Replicate(), Shard(0))), "row": (mesh, (Replicate(), Shard(0)))}
        elif layout == "two_meshes":
            grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("column", "row"))
            found = {"main": (grid, (Replicate(), Shard(0))), "row": (grid["row"], (Shard(0),))}
        else:  # pp: each half of the ranks is a stage with its own 1-D mesh and its own DMuon
            root = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
            found = {"main": (root["dp"], (Shard(0),)), "row": (root["dp"], (Shard(0),))}
        if ("other", world) not in _cache:
            _cache["other", world] = DeviceMesh("cpu", list(reversed(range(world))))
        found["other"] = (_cache["other", world], (Shard(0),))
        _cache[key] = found
    return _cache[key]


def param_specs(case: Case) -> dict[str, tuple[tuple[int, ...], str]]:
    return {**PARAMS, **(QK_PARAMS if case.qk else {})}


def placement_of(case: Case, name: str) -> tuple[Any, tuple] | None:
    """(mesh, placements) of a DTensor parameter on this layout; None for a plain tensor."""
    if name in PLAIN:
        return None
    found = meshes(case.layout, case.world)
    if name in REPLICATED:
        mesh = found["main"][0]
        return mesh, (Replicate(),) * mesh.ndim
    return found["row"] if name in ROW_PARAMS else found["main"]


def _seeded(name: str, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * salt)
    return torch.randn(shape, generator=generator)


def initial(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    return _seeded(name, shape, 0)


def base_grad(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    return _seeded(name, shape, 1 + step)


@dataclass
class Model:
    """One rank's parameters (its stage's, under pp) and the DMuon that steps them."""

    params: dict[str, nn.Parameter]
    optimizer: DMuon
    full: bool  # the one-process reference: plain full tensors


def options(case: Case) -> dict[str, Any]:
    """DMuon's keyword options for the case's setting."""
    kwargs: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1,
                              "adamw_state_dtype": {"param": None, "bf16": "bfloat16", "int8": "int8"}[case.adtype]}
    if case.setting == "telemetry":
        kwargs["telemetry"] = True
    if case.qk:
        kwargs["qk_clip_threshold"] = QK_THRESHOLD
    if case.setting == "foreach_on":
        kwargs["foreach"] = True
    if case.setting == "foreach_off":
        kwargs["foreach"] = False
    if case.setting == "fused":
        kwargs["fused"] = True
    if case.setting == "skip_nonfinite":
        kwargs["skip_nonfinite"] = True
    return kwargs


def groups(case: Case, params: dict[str, nn.Parameter]) -> list[dict[str, Any]]:
    """The Muon group (NorMuon under that setting), a NorMuon group, and the AdamW group."""
    cautious = {"cautious_weight_decay": True} if case.setting == "cautious" else {}
    by_group: dict[str, list] = {"muon": [], "normuon": [], "adamw": []}
    for name, (_, group) in param_specs(case).items():
        by_group[group].append((name, params[name]))
    return [
        {"params": by_group["muon"], "use_muon": True, "normuon": case.setting == "normuon", **cautious},
        {"params": by_group["normuon"], "use_muon": True, "normuon": True, "lr": 0.03, **cautious},
        {"params": by_group["adamw"], "use_muon": False, "lr": 0.01, "weight_decay": 0.01, **cautious},
    ]


def build(case: Case, full: bool = False) -> Model:
    """This rank's model (``full``: the one-process reference's, plain full tensors)."""
    params = {}
    for name, (shape, _) in param_specs(case).items():
        tensor = initial(name, shape)
        where = None if full else placement_of(case, name)
        if where is not None:
            tensor = distribute_tensor(tensor, where[0], list(where[1]), src_data_rank=None)
        params[name] = nn.Parameter(tensor)
        params[name].grad_dtype = None  # let a complex or bf16 grad through autograd's check
    optimizer = DMuon(groups(case, params), **options(case))
    if case.qk:
        for attention in ATTENTIONS:
            optimizer.clip_attention(attention, params[f"{attention}.wq"], params[f"{attention}.wk"], HEADS)
    return Model(params, optimizer, full)


# ------------------------------------------------------------------ grads and faults


def _block_starts(mesh: DeviceMesh, ranks: tuple[int, ...], rows: int) -> list[int]:
    """The first row of each of ``ranks``' blocks (Shard(0) on the mesh's last dim, torch.chunk's
    split), for those in the mesh with a non-empty block."""
    ids = mesh.mesh.flatten().tolist()
    n = mesh.mesh.shape[-1]
    chunk = -(-rows // n)
    starts = []
    for rank in ranks:
        if rank in ids:
            start = chunk * int((mesh.mesh == rank).nonzero()[0][-1])
            if start < rows:
                starts.append(start)
    return starts


def full_grad(case: Case, name: str, step: int, rank: int) -> torch.Tensor | None:
    """The grad as one process on this rank's data sees it: the base grad, None where the
    case drops it on every rank (DTensor) or on this rank (plain), NaN/inf where written."""
    shape = param_specs(case)[name][0]
    grad = base_grad(name, shape, step)
    if step != case.k or name != case.target:
        return grad
    where = placement_of(case, name)
    if case.kind == "none":
        drop = rank in case.ranks if where is None else all(r in case.ranks for r in _mesh_ids(where[0]))
        return None if drop else grad
    if case.kind in ("nan", "inf"):
        value = float(case.kind)
        if where is None:
            if rank in case.ranks:
                grad.view(-1)[0] = value
        else:
            for start in _block_starts(where[0], case.ranks, shape[0]):
                grad[(start,) + (0,) * (len(shape) - 1)] = value
    return grad


def _mesh_ids(mesh: DeviceMesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def set_grads(case: Case, model: Model, step: int, rank: int) -> None:
    """Every parameter's grad for ``step`` on this rank, the fault included."""
    for name, param in model.params.items():
        param.grad = None
        grad = full_grad(case, name, step, rank)
        if grad is None:
            continue
        where = None if model.full else placement_of(case, name)
        if where is not None:
            grad = distribute_tensor(grad, where[0], list(where[1]), src_data_rank=None)
        if (not model.full and step == case.k and name == case.target and rank in case.ranks
                and case.kind != "qk_no_report"):
            grad = structural_fault(case, param, grad)
            if grad is None:
                continue
        _assign(param, grad)


def _assign(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad``, a wrong shape included (autograd refuses it: ``.data`` does not)."""
    if grad.shape == param.shape:
        param.grad = grad
        return
    param.grad = torch.zeros_like(param) if not isinstance(param, DTensor) else param.detach().clone()
    param.grad.data = grad


def structural_fault(case: Case, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
    """The grad object a faulty rank holds instead of ``grad`` (its clean one)."""
    kind = case.kind
    dtensor = isinstance(param, DTensor)
    if kind in ("nan", "inf"):  # written into the full grad already
        return grad
    if kind == "none":
        return None
    if kind == "sparse":
        return grad.to_sparse()
    if kind in ("complex", "dtype"):
        dtype = torch.complex64 if kind == "complex" else torch.bfloat16
        if not dtensor:
            return grad.to(dtype)
        return DTensor.from_local(grad.to_local().to(dtype), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    if kind == "global_shape":
        shape = (param.shape[0] + 1, *param.shape[1:])
        bigger = torch.randn(shape)
        if not dtensor:
            return bigger
        return distribute_tensor(bigger, param.device_mesh, list(param.placements), src_data_rank=None)
    local = grad.to_local()
    if kind == "local_shape":
        rows = local.shape[0] + 1 if local.shape[0] == 0 else local.shape[0] - 1
        wrong = torch.randn((rows, *local.shape[1:]))
        return DTensor.from_local(wrong, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    whole = base_grad(case.target, tuple(param.shape), case.k)
    mesh = param.device_mesh
    if kind == "partial":
        first = all(c == 0 for c in mesh.get_coordinate())
        part = whole if (first or case.ranks != tuple(range(case.world))) else torch.zeros_like(whole)
        return DTensor.from_local(part, mesh, [Partial()] * mesh.ndim, run_check=False, shape=param.shape,
                                  stride=whole.stride())
    if kind == "replicate":
        return DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False, shape=param.shape,
                                  stride=whole.stride())
    if kind == "other_mesh":
        other = meshes(case.layout, case.world)["other"][0]
        return DTensor.from_local(local, other, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
    raise ValueError(f"no structural fault {kind!r}")


def report_logits(case: Case, model: Model, step: int) -> None:
    """Each attention's logits for ``step`` (the same on every rank and in the reference),
    except an attention that never reports (``qk_no_report``) at the faulty step."""
    if not case.qk:
        return
    with torch.enable_grad():  # the tracker counts training forwards only
        for index, attention in enumerate(ATTENTIONS):
            if case.kind == "qk_no_report" and step <= case.k and attention == "attn_a":
                continue
            generator = torch.Generator().manual_seed(1000 * step + index)
            q = 3 * torch.randn(1, HEADS.n_heads, 5, HEADS.head_dim, generator=generator)
            k = 3 * torch.randn(1, HEADS.n_kv_heads, 5, HEADS.head_dim, generator=generator)
            model.optimizer.max_logits.observe(attention, q, k, n_heads=HEADS.n_heads)


def stage_of(case: Case, rank: int) -> int:
    return 0 if case.layout != "pp" or rank < case.world // 2 else 1

