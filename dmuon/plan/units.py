"""Units and blocks: every Muon parameter cut into the matrices Newton-Schulz runs on,
and the part of each that every rank holds.

- a *unit* is one matrix Newton-Schulz runs on: a 2-D parameter (or one block of
  ``split_rows`` rows of it: an attention head), one expert of a 3-D ``[E, A, B]``
  stack, or a 4-D+ parameter seen as ``[shape[0], prod(rest)]``;
- each rank holds one *block* of every unit it touches: the part of the unit inside
  the rank's box of the parameter (``dmuon.plan.layout``: DTensor's placement rules on any
  mesh, so FSDP's rows, TP's columns, FSDP over TP, an EP rank's experts); under
  ``Replicate`` mesh dims (HSDP) every replica holds the same blocks.

Pure: shapes and placements in, dataclasses out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from dmuon.numerics.newton_schulz import (
    DEFAULT_GRAM_RESTARTS,
    DEFAULT_NS_ALGORITHM,
    DEFAULT_NS_STEPS,
    matrix_shape,
    newton_schulz_flops,
)
from dmuon.plan.layout import Box, Layout


@dataclass(frozen=True)
class ParamSpec:
    """One Muon parameter as the planner sees it."""

    shape: tuple[int, ...]
    """Global shape."""
    shard_dim: int = 0
    """Without ``layout``: the dim ``Shard`` cuts over a 1-D mesh of every plan rank."""
    ns_steps: int = DEFAULT_NS_STEPS
    """Newton-Schulz iterations of its group (the cost model)."""
    ns_algorithm: str = DEFAULT_NS_ALGORITHM
    """Its group's ``ns_algorithm``, as resolved for the device (``resolve_ns_algorithm``):
    what each unit costs."""
    ns_gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS
    """Its group's ``ns_gram_restarts``."""
    split_rows: int | None = None
    """Rows per separately orthogonalized block of a 2-D parameter (an attention head)."""
    layout: Layout | None = None
    """Its mesh and placements (``dmuon.plan.layout``); None: ``Layout.sharded(P, shard_dim)``."""

    def layout_on(self, world_size: int) -> Layout:
        return self.layout if self.layout is not None else Layout.sharded(world_size, self.shard_dim)

    @property
    def unit_rows(self) -> int:
        """Indices of dim 0 per unit: one expert of a 3-D stack, one block of
        ``split_rows`` rows, or else the whole parameter."""
        if len(self.shape) == 3:
            return 1
        return self.split_rows or self.shape[0]

    @property
    def num_units(self) -> int:
        return self.shape[0] // self.unit_rows if self.shape[0] else 0


@dataclass(frozen=True)
class Block:
    """The part of one unit one rank holds."""

    lo: int
    hi: int
    """The ``[lo, hi)`` slice of dim 0 of the rank's local tensor that holds it."""
    shape: tuple[int, int]
    """That slice seen as a matrix block."""
    offset: tuple[int, int]
    """Where the block sits in the unit's matrix (row, column)."""

    @cached_property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class Unit:
    """One matrix of the plan, who holds which block of it, and who orthogonalizes it."""

    param: int
    """Index of its parameter in ``OwnerPlan.params``."""
    dim0: tuple[int, int]
    """The ``[start, stop)`` range of its parameter's dim 0 it covers."""
    matrix: tuple[int, int]
    """The 2-D shape Newton-Schulz sees."""
    cost: int
    """Newton-Schulz flops."""
    blocks: tuple[tuple[int, Block], ...]
    """``(rank, block)`` of every rank holding part of it (its *holders*), by rank. They
    all get their block of the result back."""
    candidates: tuple[int, ...]
    """Ranks that may own it (its parameter's mesh, or one replica of it)."""
    owner: int = 0
    sources: tuple[int, ...] = ()
    """Holders that send their block to the owner: exactly one copy of every element
    (the owner's replica when the parameter is replicated)."""

    @property
    def numel(self) -> int:
        return self.matrix[0] * self.matrix[1]

    @property
    def holders(self) -> tuple[int, ...]:
        return tuple(rank for rank, _ in self.blocks)

    @cached_property
    def travels(self) -> bool:
        """False when one rank holds the whole matrix (it owns it, and nothing moves)."""
        return len(self.blocks) > 1

    def block(self, rank: int) -> Block | None:
        return self._by_rank.get(rank)

    def block_numel(self, rank: int) -> int:
        block = self._by_rank.get(rank)
        return block.numel if block else 0

    def is_source(self, rank: int) -> bool:
        return rank in self._sources

    def place(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Where ``rank``'s block sits in the matrix: ``(offset, shape)`` (replicas share it)."""
        block = self._by_rank[rank]
        return block.offset, block.shape

    @cached_property
    def sources_by_offset(self) -> tuple[int, ...]:
        """The sources, in the order their blocks lie in the matrix."""
        return tuple(sorted((s for s in self.sources if self.block(s)), key=lambda s: self._by_rank[s].offset))

    @cached_property
    def rows_only(self) -> bool:
        """Its sources' blocks are consecutive runs of whole rows covering the matrix,
        and every holder's block is one of them: each block is one contiguous range of
        the matrix, so the owner exchange packs it with splits (``dmuon.exchange.packing``)."""
        start = 0
        for source in self.sources_by_offset:
            (row, col), (rows, cols) = self.place(source)
            if (row, col) != (start, 0) or cols != self.matrix[1]:
                return False
            start += rows
        places = {self.place(s) for s in self.sources}
        return start == self.matrix[0] and all(self.place(holder) in places for holder in self.holders)

    def even_rows(self, world_size: int) -> bool:
        """Rank ``h`` of ``world_size`` holds rows ``[h m/P, (h+1) m/P)`` of every column
        (FSDP's ``Shard(0)`` of a matrix whose rows P divides, no replicas): the layout
        FSDP2 packs its reduce-scatter with, so the owner exchange packs results by chunks."""
        rows, cols = self.matrix
        if rows % world_size or self.holders != tuple(range(world_size)):
            return False
        chunk = rows // world_size
        return all(self.place(h) == ((h * chunk, 0), (chunk, cols)) for h in self.holders)

    @cached_property
    def _by_rank(self) -> dict[int, Block]:
        return dict(self.blocks)

    @cached_property
    def _sources(self) -> frozenset[int]:
        return frozenset(self.sources)



def layout_problem(shape: Sequence[int], layout: Layout) -> str | None:
    """Why the owner exchange cannot move this parameter's blocks (None: it can)."""
    boxes = layout.boxes(shape)
    if any(box is None for box in boxes.values()):
        return "some rank's shard is not one contiguous block"
    if len(shape) >= 4 and any(box[d] != (0, shape[d]) for box in boxes.values() for d in range(1, len(shape)) if box[0][1]):
        return "a 4-D+ weight sharded past dim 0 (its flattened columns interleave)"
    return None


def _block(shape: Sequence[int], box: Box | None, dim0: tuple[int, int]) -> Block | None:
    """The block of the unit covering ``dim0`` that a rank holding ``box`` has."""
    if box is None or any(length == 0 for _, length in box):
        return None
    start, length = box[0]
    lo, hi = max(start, dim0[0]), min(start + length, dim0[1])
    if lo >= hi:
        return None
    if len(shape) == 3:  # one expert: the box's rows and columns of it
        (row, rows), (col, cols) = box[1], box[2]
        return Block(lo - start, hi - start, (rows, cols), (row, col))
    cols = math.prod(length for _, length in box[1:])
    return Block(lo - start, hi - start, (hi - lo, cols), (lo - dim0[0], box[1][0] if len(shape) == 2 else 0))


def make_units(params: Sequence[ParamSpec], world_size: int, split_replicas: bool = True) -> list[Unit]:
    """Every parameter cut into units, each with its holders' blocks and the ranks
    that may own it.

    A unit every holder has whole (an expert held whole by its EP rank, on every
    replica) becomes one unit per holder, owned there: no communication. Otherwise, on
    a replicated parameter, ``split_replicas`` makes one unit that any rank of the
    mesh may own (Newton-Schulz split over all replicas; the result goes back to every
    replica); without it, each replica gets its own copy of the unit, owned inside
    the replica (every replica runs Newton-Schulz on every matrix, as FSDP2 Muon does).
    """
    units = []
    for index, spec in enumerate(params):
        layout = spec.layout_on(world_size)
        problem = layout_problem(spec.shape, layout)
        if problem:
            raise ValueError(f"parameter {index} of shape {spec.shape}: {problem}")
        boxes = layout.boxes(spec.shape)
        replica = layout.replica()
        mesh_ranks = tuple(sorted(layout.mesh_ranks))
        replicas = sorted(set(replica.values()))
        for u in range(spec.num_units):
            dim0 = (u * spec.unit_rows, (u + 1) * spec.unit_rows)
            matrix = matrix_shape((dim0[1] - dim0[0],) + spec.shape[1:])[-2:]
            matrix = (matrix[0], matrix[1])
            cost = newton_schulz_flops(matrix, spec.ns_steps, spec.ns_algorithm, spec.ns_gram_restarts)
            blocks = [(r, b) for r in mesh_ranks if (b := _block(spec.shape, boxes[r], dim0))]
            if not blocks:
                continue
            if all(b.numel == matrix[0] * matrix[1] for _, b in blocks):
                units += [Unit(index, dim0, matrix, cost, ((r, b),), (r,)) for r, b in blocks]
            elif split_replicas or len(replicas) == 1:
                units.append(Unit(index, dim0, matrix, cost, tuple(blocks), mesh_ranks))
            else:
                for key in replicas:
                    members = tuple(r for r in mesh_ranks if replica[r] == key)
                    units.append(Unit(index, dim0, matrix, cost, tuple((r, b) for r, b in blocks if replica[r] == key), members))
    return units


def owned_cost(units: Sequence[Unit], batch: Sequence[int], rank: int) -> int:
    """Newton-Schulz flops of the units of ``batch`` that ``rank`` owns."""
    return sum(units[i].cost for i in batch if units[i].owner == rank)
