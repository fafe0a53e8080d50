"""Batches: cut only so that communication overlaps Newton-Schulz and scratch memory
stays bounded. Each batch is a "shelf" whose height is the largest remaining unit, filled
by every rank up to that height, so every rank has work in every batch and the step's
critical path (the sum of the batches' slowest ranks) stays close to the whole-step LPT
bound. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from dmuon.plan.units import Unit, owned_costs

# Each rank owns at most this many elements of travelling matrices in one batch, or as many
# as the batch's tallest matrix (its owner needs that much anyway): it bounds the scratch.
DEFAULT_BATCH_NUMEL = 1 << 27
# Shelves are merged into about this many batches when memory allows: enough for the
# next batch's gather and the previous batch's scatter to hide behind Newton-Schulz,
# few enough to keep the number of collectives small.
OVERLAP_BATCHES = 4


def make_batches(units: Sequence[Unit], world_size: int, max_batch_numel: int) -> tuple[tuple[int, ...], ...]:
    """Shelves (every rank fills each up to its tallest unit), merged under the memory cap."""
    shelves = _shelves(units, world_size, max_batch_numel)
    if not shelves:
        return ()
    heights = [max(owned_costs(units, shelf, world_size)) for shelf in shelves]
    target = sum(heights) / OVERLAP_BATCHES
    batches: list[list[int]] = []
    height = 0
    for shelf, shelf_height in zip(shelves, heights):
        merged = (batches[-1] + shelf) if batches else None
        if merged is not None and height + shelf_height <= target and _fits(units, merged, world_size, max_batch_numel):
            batches[-1] = merged
            height += shelf_height
        else:
            batches.append(list(shelf))
            height = shelf_height
    # Shelves come tallest first, so only the last batch can fall far short of the target: one
    # that short would pay two collectives' latency to hide little work, so it joins the one
    # before it where memory allows.
    if len(batches) > 1 and height < target / OVERLAP_BATCHES and _fits(units, batches[-2] + batches[-1],
                                                                         world_size, max_batch_numel):
        batches[-2].extend(batches.pop())
    return tuple(tuple(sorted(batch)) for batch in batches)


def _shelves(units: Sequence[Unit], world_size: int, max_batch_numel: int) -> list[list[int]]:
    """First-fit decreasing shelves: each shelf's height is the tallest unit any rank has
    left; every rank packs its own remaining units (largest first) into it while they fit
    under that height and within ``max(max_batch_numel, the tallest unit's elements)``
    travelling elements (that unit's owner needs that much scratch anyway)."""
    queues: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(units)), key=lambda i: (-units[i].cost, i)):
        queues[units[i].owner].append(i)
    shelves = []
    while any(queues):
        tallest = units[max((q[0] for q in queues if q), key=lambda i: (units[i].cost, -i))]
        height = tallest.cost
        allowance = max(max_batch_numel, tallest.numel if tallest.travels else 0)
        shelf: list[int] = []
        for r, queue in enumerate(queues):
            load = numel = 0
            rest = []
            for position, i in enumerate(queue):
                unit = units[i]
                size = unit.numel if unit.travels else 0
                fits = load + unit.cost <= height and numel + size <= allowance
                if position == 0 or fits:
                    shelf.append(i)
                    load += unit.cost
                    numel += size
                else:
                    rest.append(i)
                    if load + units[queue[-1]].cost > height:  # not even the smallest fits
                        rest.extend(queue[position + 1 :])
                        break
            queues[r] = rest
        shelves.append(shelf)
    return shelves


def _fits(units: Sequence[Unit], batch: Sequence[int], world_size: int, cap: int) -> bool:
    owned = [0] * world_size
    for i in batch:
        if units[i].travels:
            owned[units[i].owner] += units[i].numel
    return max(owned) <= cap
