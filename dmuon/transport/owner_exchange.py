"""The owner exchange: one step of the owner-computed fast path, for any layout the plan describes.

The schedule is ``dmuon.plan.batch_schedule``, written once as data: this module runs
it, ``dmuon.plan.scratch_events`` predicts its memory and ``dmuon.cost_model`` its time.
Per batch ``b`` (every rank issues the same collectives in the same order):

1. gather ``b`` completes; each owner cuts its whole matrices from the receive buffer;
2. gather ``b + 1`` starts (momentum runs for its blocks as they are packed), so it
   travels while this rank runs Newton-Schulz;
3. Newton-Schulz on the units this rank keeps whole (applied at once) and on the
   travelling units it owns;
4. scatter ``b`` starts; scatter ``b - 1`` completes and its blocks are applied.

So at most three batches' buffers are alive at once, and each is freed as soon as
it has been used: the scratch is bounded per batch, not per step.

The optimizer supplies the math as three callables, so this module knows nothing of
param groups or state:

- ``update_block(param, lo, hi, shape)``: momentum on dim-0 rows ``[lo, hi)`` of the
  parameter's local tensor; returns the bf16 update reshaped to ``shape``;
- ``orthogonalize(unit, matrix)``: Newton-Schulz with the settings of the unit's
  parameter's group (``unit.param``; ``unit.dim0``: the rows of it the matrix is);
- ``apply_block(param, lo, hi, ortho)``: the decayed, scaled update of those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, Exchange, ScratchMeter, pack_gather, pack_scatter, unpack_gather, unpack_scatter
from dmuon.plan import (
    FINISH_GATHER,
    NEWTON_SCHULZ,
    START_GATHER,
    START_SCATTER,
    OwnerPlan,
    Unit,
    batch_schedule,
)

UpdateBlock = Callable[[int, int, int, tuple[int, int]], torch.Tensor]
Orthogonalize = Callable[[Unit, torch.Tensor], torch.Tensor]
ApplyBlock = Callable[[int, int, int, torch.Tensor], None]


def run_owner_plan(
    plan: OwnerPlan,
    present: Collection[int],
    *,
    group: dist.ProcessGroup,
    rank: int,
    device: torch.device,
    update_block: UpdateBlock,
    orthogonalize: Orthogonalize,
    apply_block: ApplyBlock,
    stats: CommStats,
    meter: ScratchMeter,
) -> None:
    """Orthogonalize and apply every unit of ``plan`` whose parameter is in ``present``
    (the parameters with a grad, the same set on every rank)."""
    batches = [[i for i in batch if plan.units[i].param in present] for batch in plan.batches]
    batches = [batch for batch in batches if batch]
    if not batches:
        return
    step = _OwnerStep(plan, group, rank, device, update_block, orthogonalize, apply_block, stats, meter)
    # What is in flight, by batch: each entry lives from one event of the schedule to the next.
    gathers: dict[int, Exchange] = {}
    owned: dict[int, dict[int, torch.Tensor]] = {}
    results: dict[int, dict[int, torch.Tensor]] = {}
    scatters: dict[int, Exchange] = {}
    for event, b in batch_schedule(len(batches)):
        batch = batches[b]
        if event == START_GATHER:
            gathers[b] = step.start_gather(batch)
        elif event == FINISH_GATHER:
            owned[b] = step.finish_gather(batch, gathers.pop(b))
        elif event == NEWTON_SCHULZ:
            step.orthogonalize_kept(batch)
            results[b] = step.orthogonalize_owned(owned.pop(b))
        elif event == START_SCATTER:
            scatters[b] = step.start_scatter(batch, results.pop(b))
        else:
            step.finish_scatter(batch, scatters.pop(b))


@dataclass
class _OwnerStep:
    """The named steps of :func:`run_owner_plan` for one rank. Each frees its scratch
    (``meter.free`` and ``del``) as soon as the schedule lets go of it."""

    plan: OwnerPlan
    group: dist.ProcessGroup
    rank: int
    device: torch.device
    update_block: UpdateBlock
    orthogonalize: Orthogonalize
    apply_block: ApplyBlock
    stats: CommStats
    meter: ScratchMeter

    def block_of(self, unit_index: int) -> torch.Tensor:
        """This rank's block of a unit's update (momentum runs here)."""
        unit = self.plan.units[unit_index]
        block = unit.block(self.rank)
        return self.meter.track(self.update_block(unit.param, block.lo, block.hi, block.shape))

    def apply(self, unit_index: int, ortho: torch.Tensor) -> None:
        unit = self.plan.units[unit_index]
        block = unit.block(self.rank)
        self.apply_block(unit.param, block.lo, block.hi, ortho)

    def start_gather(self, batch: list[int]) -> Exchange:
        send = pack_gather(self.plan, batch, self.rank, self.block_of, self.device, self.meter)
        return Exchange(send, *self.plan.gather_splits(batch, self.rank), self.group, self.rank, self.stats,
                        self.device, self.meter)

    def finish_gather(self, batch: list[int], gather: Exchange) -> dict[int, torch.Tensor]:
        """The whole matrices this rank owns in ``batch``, cut from the receive buffer."""
        recv = gather.wait()
        full = unpack_gather(self.plan, batch, self.rank, recv, self.meter)
        self.meter.free(recv)
        return full

    def orthogonalize_kept(self, batch: list[int]) -> None:
        """The units this rank holds whole and keeps: orthogonalized and applied at once."""
        for i in self.plan.kept_local(batch, self.rank):
            update = self.block_of(i)
            ortho = self.meter.track(self.orthogonalize(self.plan.units[i], update))
            self.meter.free(update)
            del update
            self.apply(i, ortho)
            self.meter.free(ortho)
            del ortho

    def orthogonalize_owned(self, full: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Newton-Schulz of the gathered matrices; each input is freed once used."""
        results: dict[int, torch.Tensor] = {}
        for i in list(full):
            matrix = full.pop(i)
            results[i] = self.meter.track(self.orthogonalize(self.plan.units[i], matrix))
            self.meter.free(matrix)
            del matrix
        return results

    def start_scatter(self, batch: list[int], results: dict[int, torch.Tensor]) -> Exchange:
        send = pack_scatter(self.plan, batch, self.rank, results, self.device, self.meter)
        for result in results.values():
            self.meter.free(result)
        results.clear()
        return Exchange(send, *self.plan.scatter_splits(batch, self.rank), self.group, self.rank, self.stats,
                        self.device, self.meter)

    def finish_scatter(self, batch: list[int], scatter: Exchange) -> None:
        recv = scatter.wait()
        for i, block in unpack_scatter(self.plan, batch, self.rank, recv).items():
            self.apply(i, block)
        self.meter.free(recv)
