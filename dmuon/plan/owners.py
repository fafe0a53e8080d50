"""Who orthogonalizes which unit: longest-processing-time (LPT) over the whole step, by
Newton-Schulz flops, so every rank carries the same cost. Pure."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from dmuon.plan.units import Unit


def assign_owners(costs: Sequence[int], world_size: int, loads: Sequence[int] | None = None,
                  candidates: Sequence[tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """Balance costs over ranks: longest job first, each to the least-loaded rank (of
    ``candidates[i]``, the ranks job ``i`` may go to; default: every rank), on top of the
    ``loads`` they already carry. Ties (equal cost, equal load) go to the lower index and
    the lower rank, so every rank computes the same assignment (round-robin on idle ranks).
    """
    loads = [0] * world_size if loads is None else list(loads)
    everyone = tuple(range(world_size))
    owners = [0] * len(costs)
    # One heap per candidate set; an entry whose load is stale is refreshed on pop.
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        ranks = everyone if candidates is None else candidates[index]
        heap = heaps.get(ranks)
        if heap is None:
            heap = heaps[ranks] = [(loads[r], r) for r in ranks]
            heapq.heapify(heap)
        load, rank = heapq.heappop(heap)
        while load != loads[rank]:
            load, rank = heapq.heappushpop(heap, (loads[rank], rank))
        owners[index] = rank
        loads[rank] += costs[index]
        heapq.heappush(heap, (loads[rank], rank))
    return tuple(owners)


def whole_step_owners(units: Sequence[Unit], world_size: int) -> tuple[int, ...]:
    """A unit with one candidate (held whole there) is owned there; the rest go LPT over
    the whole step (:func:`assign_owners`), each to one of its candidate ranks."""
    owners = [0] * len(units)
    loads = [0] * world_size
    free: list[int] = []
    for i, unit in enumerate(units):
        if len(unit.candidates) == 1:
            owners[i] = unit.candidates[0]
            loads[owners[i]] += unit.cost
        else:
            free.append(i)
    chosen = assign_owners([units[i].cost for i in free], world_size, loads, [units[i].candidates for i in free])
    for i, owner in zip(free, chosen):
        owners[i] = owner
    return tuple(owners)
