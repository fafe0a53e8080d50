"""Every Muon parameter cut into units (``dmuon.plan.units``), and whether the owner
exchange can move its blocks at all. Pure.

Time: who holds a unit (how many ranks, whether each holds it whole, how many in each
replica) is found once per box table and dim-0 range, O(P) each, not once per unit: a
model repeats its shapes layer after layer, so planning does not grow with units x P.
"""

from __future__ import annotations

from collections.abc import Sequence

from dmuon.numerics.newton_schulz import matrix_shape, newton_schulz_flops
from dmuon.plan.layout import BoxTable, Layout
from dmuon.plan.units import ParamSpec, Unit, block_of


def layout_problem(shape: Sequence[int], layout: Layout) -> str | None:
    """Why the owner exchange cannot move this parameter's blocks (None: it can)."""
    boxes = layout.boxes(shape)
    if not boxes.all_boxes:
        return "some rank's shard is not one contiguous block"
    if len(shape) >= 4 and any(box[d] != (0, shape[d]) for box in boxes.values()
                               for d in range(1, len(shape)) if box[0][1]):
        return "a 4-D+ weight sharded past dim 0 (its flattened columns interleave)"
    return None


def _holding(boxes: BoxTable, dim0: tuple[int, int], numel: int
             ) -> tuple[int, tuple[int, ...] | None, dict[tuple[int, ...], int]]:
    """Who holds rows ``dim0``: how many ranks, the holders when each holds them whole (else
    None), and the holders in each replica."""
    layout = boxes.layout
    blocks = [(r, b) for r in layout.sorted_ranks if (b := block_of(boxes.shape, boxes[r], dim0))]
    per_replica: dict[tuple[int, ...], int] = {}
    for rank, _ in blocks:
        key = layout.replica_of(rank)
        per_replica[key] = per_replica.get(key, 0) + 1
    whole = tuple(r for r, _ in blocks) if all(b.numel == numel for _, b in blocks) else None
    return len(blocks), whole, per_replica


def make_units(params: Sequence[ParamSpec], world_size: int, split_replicas: bool = True) -> list[Unit]:
    """Every parameter cut into units, each with its holders' blocks and the ranks that may own it.

    A unit every holder has whole (an expert held whole by its EP rank) becomes one unit
    per holder, owned there: no communication. Otherwise, on a replicated parameter,
    ``split_replicas`` makes one unit any rank of the mesh may own (its result goes back to
    every replica); without it, each replica gets its own copy of the unit, owned inside
    the replica (every replica runs Newton-Schulz on every matrix, as FSDP2 Muon does).
    """
    units = []
    holdings: dict[tuple[int, tuple[int, int]], tuple] = {}  # once per box table and rows: a model repeats them
    for index, spec in enumerate(params):
        layout = spec.layout_on(world_size)
        problem = layout_problem(spec.shape, layout)
        if problem:
            raise ValueError(f"parameter {index} of shape {spec.shape}: {problem}")
        boxes = layout.boxes(spec.shape)
        replicas = boxes.layout.replica_keys()
        for u in range(spec.num_units):
            dim0 = (u * spec.unit_rows, (u + 1) * spec.unit_rows)
            rows, cols = matrix_shape((dim0[1] - dim0[0],) + spec.shape[1:])[-2:]
            matrix = (rows, cols)
            cost = newton_schulz_flops(matrix, spec.ns_steps, spec.ns_algorithm, spec.ns_gram_restarts)
            where = (id(boxes), dim0)
            if where not in holdings:
                holdings[where] = _holding(boxes, dim0, rows * cols)
            count, whole, per_replica = holdings[where]
            if not count:
                continue
            if whole is not None:
                units += [Unit(index, dim0, matrix, cost, boxes, False, whole_at=r) for r in whole]
            elif split_replicas or len(replicas) == 1:
                units.append(Unit(index, dim0, matrix, cost, boxes, count > 1))
            else:
                units += [Unit(index, dim0, matrix, cost, boxes, per_replica.get(key, 0) > 1, replica=key)
                          for key in replicas]
    return units
