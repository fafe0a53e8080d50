"""The owner exchange: one step of the owner-computed fast path, for any layout the plan describes.

The schedule, per batch ``b`` (every rank issues the same collectives in the same
order; ``dmuon.plan.scratch_events`` writes the same schedule as arithmetic):

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
- ``orthogonalize(param, matrix)``: Newton-Schulz with the parameter's group settings;
- ``apply_block(param, lo, hi, ortho)``: the decayed, scaled update of those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, Exchange, ScratchMeter, pack_gather, pack_scatter, unpack_gather, unpack_scatter
from dmuon.plan import OwnerPlan

UpdateBlock = Callable[[int, int, int, tuple[int, int]], torch.Tensor]
Orthogonalize = Callable[[int, torch.Tensor], torch.Tensor]
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

    def block_of(unit_index: int) -> torch.Tensor:
        unit = plan.units[unit_index]
        block = unit.block(rank)
        return meter.track(update_block(unit.param, block.lo, block.hi, block.shape))

    def apply(unit_index: int, ortho: torch.Tensor) -> None:
        unit = plan.units[unit_index]
        block = unit.block(rank)
        apply_block(unit.param, block.lo, block.hi, ortho)

    def start_gather(batch: list[int]) -> Exchange:
        send = pack_gather(plan, batch, rank, block_of, device, meter)
        return Exchange(send, *plan.gather_splits(batch, rank), group, rank, stats, device, meter)

    def finish_scatter(batch: list[int], scatter: Exchange) -> None:
        recv = scatter.wait()
        for i, block in unpack_scatter(plan, batch, rank, recv).items():
            apply(i, block)
        meter.free(recv)

    gather = start_gather(batches[0])
    previous: tuple[list[int], Exchange] | None = None
    for k, batch in enumerate(batches):
        recv = gather.wait()
        full = unpack_gather(plan, batch, rank, recv, meter)
        meter.free(recv)
        del recv
        if k + 1 < len(batches):
            gather = start_gather(batches[k + 1])
        for i in plan.kept_local(batch, rank):
            update = block_of(i)
            ortho = meter.track(orthogonalize(plan.units[i].param, update))
            meter.free(update)
            del update
            apply(i, ortho)
            meter.free(ortho)
            del ortho
        results: dict[int, torch.Tensor] = {}
        for i in list(full):
            matrix = full.pop(i)
            results[i] = meter.track(orthogonalize(plan.units[i].param, matrix))
            meter.free(matrix)
            del matrix
        send = pack_scatter(plan, batch, rank, results, device, meter)
        for result in results.values():
            meter.free(result)
        results.clear()
        scatter = Exchange(send, *plan.scatter_splits(batch, rank), group, rank, stats, device, meter)
        del send
        if previous is not None:
            finish_scatter(*previous)
        previous = (batch, scatter)
    finish_scatter(*previous)

