"""The parallel layouts ``benchmarks.bench --layout`` builds, and the bytes each must send.

Each layout is built the way TorchTitan builds it, with PyTorch's own APIs, so the
placements are the real ones:

- ``fsdp``: ``fully_shard`` on a 1-D mesh: ``Shard(0)``;
- ``hsdp``: ``fully_shard`` on a ``(dp_replicate, dp_shard)`` mesh: ``(Replicate(), Shard(0))``;
- ``fsdp_tp``: ``ColwiseParallel`` (wq wk wv w1 w3) and ``RowwiseParallel`` (wo w2) on
  ``tp``, then ``fully_shard`` on ``dp_shard``: ``(_StridedShard(0), Shard(0))`` and
  ``(Shard(0), Shard(1))``;
- ``tp``: tensor parallel over every rank: ``Shard(0)`` and ``Shard(1)``.

The minimum bytes each layout must send are ``dmuon.tools.plan_report.min_bytes_per_rank``.
``as_dtensor`` is also the tests' way to lay a full tensor out as a DTensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon.tools import compute_local_shape_and_global_offset

LAYOUTS = ("fsdp", "hsdp", "fsdp_tp", "tp")
COLWISE = ("wq", "wk", "wv", "w1", "w3")
ROWWISE = ("wo", "w2")


def default_mesh_shape(layout: str, world_size: int) -> tuple[int, ...]:
    """fsdp and tp: every rank on one dim; hsdp: 2 replicas; fsdp_tp: TP degree 2."""
    if layout in ("hsdp", "fsdp_tp"):
        if world_size % 2:
            raise ValueError(f"--layout {layout} needs an even world size, got {world_size}")
        return (2, world_size // 2) if layout == "hsdp" else (world_size // 2, 2)
    return (world_size,)


def parallelize(model: nn.Sequential, layout: str, mesh_shape: tuple[int, ...], device_type: str) -> None:
    """Shard ``model`` (a stack of blocks with wq ... w3) in place for ``layout``."""
    if layout == "fsdp":
        _fully_shard(model, init_device_mesh(device_type, mesh_shape, mesh_dim_names=("dp_shard",)))
    elif layout == "hsdp":
        _fully_shard(model, init_device_mesh(device_type, mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard")))
    elif layout in ("fsdp_tp", "tp"):
        names = ("dp_shard", "tp") if layout == "fsdp_tp" else ("tp",)
        mesh = init_device_mesh(device_type, mesh_shape, mesh_dim_names=names)
        plan = {name: ColwiseParallel() for name in COLWISE} | {name: RowwiseParallel() for name in ROWWISE}
        for block in model:
            parallelize_module(block, mesh["tp"], plan)
        if layout == "fsdp_tp":
            _fully_shard(model, mesh["dp_shard"])
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")


def _fully_shard(model: nn.Sequential, mesh: DeviceMesh) -> None:
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def as_dtensor(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """This rank's block of ``full``, where DTensor itself says it lives
    (``compute_local_shape_and_global_offset``: no dmuon layout code involved)."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


def like(param: DTensor, full: torch.Tensor) -> DTensor:
    """``full`` laid out like ``param``."""
    return as_dtensor(full, param.device_mesh, param.placements)
