"""The small all-reduces of a step, beside the owner exchange's all_to_alls: NorMuon's
per-row state shared after the owners wrote it, QK-clip's per-head max logits, and the
telemetry's per-step sums. Each is one collective on the mesh's device."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from dmuon.plan.owner_plan import OwnerPlan
from dmuon.plan.units import Unit


def _many_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def max_in_place(flat: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every rank's ``flat`` becomes the elementwise MAX over ``group`` (nothing to do
    without a process group or with one rank)."""
    if _many_ranks():
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)


def start_sum(flat: torch.Tensor) -> dist.Work | None:
    """Start summing ``flat`` over every rank in place; the work to wait on, or None
    (nothing to sum without a process group or with one rank)."""
    return dist.all_reduce(flat, async_op=True) if _many_ranks() else None


def reporting_units(plan: OwnerPlan, rank: int) -> list[Unit]:
    """The units whose rows ``rank`` reports in :func:`share_second_moments`: of the units
    covering the same rows of a parameter, the one of the lowest owner (each row once)."""
    first: dict[tuple[int, tuple[int, int]], Unit] = {}
    for unit in plan.units:
        key = (unit.param, unit.dim0)
        if key not in first or unit.owner < first[key].owner:
            first[key] = unit
    return [unit for unit in first.values() if unit.owner == rank]


def share_second_moments(plan: OwnerPlan, rank: int, moments: Mapping[int, torch.Tensor],
                         group: dist.ProcessGroup, device: torch.device) -> None:
    """Make every rank's copy of the NorMuon state ``moments`` (plan parameter index ->
    the whole rows on this rank; the same keys on every rank) equal to what the owners
    wrote this step: each rank contributes the rows it reports (:func:`reporting_units`)
    and zeros elsewhere, and one ``all_reduce`` sums them per dtype. A sum of one value
    and zeros is that value, so every copy gets the owner's bits."""
    mine = reporting_units(plan, rank)
    for dtype in sorted({m.dtype for m in moments.values()}, key=str):
        members = [(j, m) for j, m in sorted(moments.items()) if m.dtype == dtype]
        flat = torch.zeros(sum(m.numel() for _, m in members), dtype=dtype, device=device)
        views, offset = [], 0
        for j, moment in members:
            view = flat[offset : offset + moment.numel()].view(moment.shape)
            for unit in (u for u in mine if u.param == j):
                view[unit.dim0[0] : unit.dim0[1]].copy_(moment[unit.dim0[0] : unit.dim0[1]])
            views.append((moment, view))
            offset += moment.numel()
        dist.all_reduce(flat, group=group)
        for moment, view in views:
            moment.copy_(view)
