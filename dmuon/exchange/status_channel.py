"""Which DTensor parameters of one ``DMuon`` share the step's status reduction, and over
which ranks: the union of their meshes' ranks (one reduction, so one rank's problem masks
all of them), the parameters on a strict subset of it (a grid's row, a stage's mesh)
counted over their own ranks first. Made once, at planning: a group no mesh provides is
made here, never in a steady step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dmuon.exchange.comm import mesh_device
from dmuon.exchange.groups import group_of
from dmuon.exchange.host_copy import to_device
from dmuon.exchange.replicated_grads import replicated
from dmuon.plan.mesh_facts import mesh_ranks


def distributed(param: torch.Tensor) -> bool:
    """Whether a parameter's step may involve other ranks: a DTensor (on a mesh of one
    rank too, so that every DTensor takes the one masked step)."""
    return isinstance(param, DTensor)


@dataclass
class RankSet:
    """DTensor parameters on meshes of one strict subset of the union's ranks: the same index may be
    another parameter on another subset, so their grads are counted over their own ranks first."""

    positions: list[int]
    """Where they stand among the channel's parameters."""
    group: dist.ProcessGroup | None
    _index: torch.Tensor | None = None

    def index(self, device: torch.device) -> torch.Tensor:
        """``positions`` on the device, made once."""
        if self._index is None:
            self._index = to_device(self.positions, device, torch.int64)
        return self._index


@dataclass
class StatusChannel:
    """The DTensor parameters of one ``DMuon`` and where their status is summed (module
    docstring)."""

    params: list[DTensor]
    names: list[str]
    """The parameters' names, for the error of a later step."""
    group: dist.ProcessGroup | None
    """None where the union is this rank alone: the sums are this rank's own."""
    device: torch.device
    subsets: list[RankSet]
    """Parameters on strict subsets of the union, by rank set (usually none)."""
    replicated: list[DTensor]
    """Parameters replicated on every dim of their mesh, whose grads every rank sums at
    every step (``dmuon.exchange.replicated_grads``)."""


def status_channel(params: Sequence[torch.Tensor], name_of: Callable[[torch.Tensor], str]) -> StatusChannel | None:
    """The channel of every DTensor among ``params`` (None without any)."""
    dtensors = [p for p in params if distributed(p)]
    if not dtensors:
        return None
    meshes = list({id(p.device_mesh): p.device_mesh for p in dtensors}.values())
    ranks = tuple(sorted({r for mesh in meshes for r in mesh_ranks(mesh)}))
    group = group_of(ranks, meshes) if len(ranks) > 1 else None
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for j, param in enumerate(dtensors):
        own = mesh_ranks(param.device_mesh)
        if own != ranks:
            by_ranks.setdefault(own, []).append(j)
    subsets = [RankSet(positions, group_of(own, [dtensors[positions[0]].device_mesh]) if len(own) > 1 else None)
               for own, positions in by_ranks.items()]
    return StatusChannel(dtensors, [name_of(p) for p in dtensors], group, mesh_device(meshes[0]), subsets,
                         [p for p in dtensors if replicated(p)])
