"""Units and blocks. Pure: shapes and placements in, dataclasses out.

- a *unit* is one matrix Newton-Schulz runs on: a 2-D parameter (or one block of
  ``split_rows`` rows of it: an attention head), one expert of a 3-D ``[E, A, B]``
  stack, or a 4-D+ parameter seen as ``[shape[0], prod(rest)]``;
- each rank holds one *block* of every unit it touches: the part of the unit inside
  the rank's box of the parameter (``dmuon.plan.layout``); under ``Replicate`` mesh dims
  (HSDP) every replica holds the same blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from dmuon.numerics.newton_schulz import DEFAULT_GRAM_RESTARTS, DEFAULT_NS_ALGORITHM, DEFAULT_NS_STEPS
from dmuon.plan.layout import Box, BoxTable, Layout


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

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class Unit:
    """One matrix of the plan, who holds which block of it, and who orthogonalizes it.

    Memory: a unit keeps its parameter's box table (shared by every parameter of that
    layout and shape) and which of the mesh's ranks it spans, not a block per holder:
    under FSDP every rank holds a block of every unit, so per-holder blocks would cost
    units x P on every rank. A rank's block is computed when asked (O(tensor dims));
    every holder's (:attr:`blocks`, :attr:`sources`) only where needed: the units a rank
    owns, and tools that report every rank."""

    param: int
    """Index of its parameter in ``OwnerPlan.params``."""
    dim0: tuple[int, int]
    """The ``[start, stop)`` range of its parameter's dim 0 it covers."""
    matrix: tuple[int, int]
    """The 2-D shape Newton-Schulz sees."""
    cost: int
    """Newton-Schulz flops."""
    boxes: BoxTable = field(repr=False, compare=False)
    """Every rank's box of its parameter."""
    travels: bool = True
    """False when one rank holds the whole matrix (it owns it, and nothing moves)."""
    replica: tuple[int, ...] | None = None
    """Replicas kept apart: the replica whose ranks hold it (None: every replica)."""
    whole_at: int | None = None
    """Held whole, one unit per holder: the one rank holding this one."""
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.matrix[0] * self.matrix[1]

    @property
    def blocks(self) -> tuple[tuple[int, Block], ...]:
        """``(rank, block)`` of every rank holding part of it (its *holders*), by rank. They
        all get their block of the result back. O(P): computed, not kept."""
        return tuple(self.holder_blocks())

    @property
    def holders(self) -> tuple[int, ...]:
        return tuple(rank for rank, _ in self.holder_blocks())

    @property
    def candidates(self) -> tuple[int, ...]:
        """Ranks that may own it (its parameter's mesh, or one replica of it): tuples
        shared by every unit of the layout."""
        layout = self.boxes.layout
        if self.whole_at is not None:
            return (self.whole_at,)
        return layout.sorted_ranks if self.replica is None else layout.members(self.replica)

    @property
    def sources(self) -> tuple[int, ...]:
        """Holders that send their block to the owner: exactly one copy of every element
        (the owner's replica when the parameter is replicated)."""
        return tuple(rank for rank, _ in self.source_blocks())

    @property
    def kind(self) -> tuple:
        """Units of one kind are held alike (every rank's block of them is the same): one
        parameter layout and shape, one range of rows, one scope. Who holds what is worked
        out once per kind, not once per unit."""
        return id(self.boxes), self.dim0, self.replica, self.whole_at

    def holder_blocks(self) -> Iterator[tuple[int, Block]]:
        """``(rank, block)`` of every holder, by rank."""
        shape, boxes, dim0 = self.boxes.shape, self.boxes, self.dim0
        for rank, position in self._scope():
            block = block_of(shape, boxes.at(position), dim0)
            if block is not None:
                yield rank, block

    def holder_numels(self) -> Iterator[tuple[int, int]]:
        """``(rank, elements of its block)`` of every holder, by rank: what the splits
        need, without making the blocks."""
        boxes, dim0 = self.boxes, self.dim0
        for rank, position in self._scope():
            numel = boxes.numel_at(position, dim0)
            if numel:
                yield rank, numel

    def source_blocks(self) -> Iterator[tuple[int, Block]]:
        """``(rank, block)`` of every source, by rank."""
        return ((r, b) for r, b in self.holder_blocks() if self.in_owner_replica(r))

    def in_owner_replica(self, rank: int) -> bool:
        """Whether ``rank`` is in its owner's replica of the parameter (every rank is,
        without replicas)."""
        layout = self.boxes.layout
        return not layout.has_replicas or layout.replica_of(rank) == layout.replica_of(self.owner)

    def block(self, rank: int) -> Block | None:
        position = self._position(rank)
        return None if position is None else block_of(self.boxes.shape, self.boxes.at(position), self.dim0)

    def block_numel(self, rank: int) -> int:
        position = self._position(rank)
        return 0 if position is None else self.boxes.numel_at(position, self.dim0)

    def is_source(self, rank: int) -> bool:
        return self.block_numel(rank) > 0 and self.in_owner_replica(rank)

    def _scope(self) -> Iterator[tuple[int, int]]:
        """``(rank, mesh position)`` of every rank that may hold part of it, by rank."""
        position = self.boxes.layout.position
        return ((rank, position(rank)) for rank in self.candidates)

    def _position(self, rank: int) -> int | None:
        """``rank``'s mesh position, or None when it cannot hold part of it (not in its
        mesh, or out of its scope)."""
        if self.whole_at is not None and rank != self.whole_at:
            return None
        layout = self.boxes.layout
        try:
            position = layout.position(rank)
        except KeyError:
            return None
        if self.replica is not None and layout.replica_at(position) != self.replica:
            return None
        return position

    def place(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Where ``rank``'s block sits in the matrix: ``(offset, shape)`` (replicas share it)."""
        block = self.block(rank)
        if block is None:
            raise KeyError(rank)
        return block.offset, block.shape

    @property
    def sources_by_offset(self) -> tuple[int, ...]:
        """The sources, in the order their blocks lie in the matrix."""
        return tuple(rank for rank, _ in self._sources_by_offset())

    def _sources_by_offset(self) -> list[tuple[int, Block]]:
        return sorted(self.source_blocks(), key=lambda source: source[1].offset)

    @cached_property
    def rows_only(self) -> bool:
        """Its sources' blocks are consecutive runs of whole rows covering the matrix,
        and every holder's block is one of them: each block is one contiguous range of
        the matrix, so the owner exchange packs it with splits (``dmuon.exchange.packing``).
        Kept: one flag, asked for every owned unit in every batch."""
        start = 0
        places = set()
        for _, block in self._sources_by_offset():
            (row, col), (rows, cols) = block.offset, block.shape
            if (row, col) != (start, 0) or cols != self.matrix[1]:
                return False
            start += rows
            places.add((block.offset, block.shape))
        return start == self.matrix[0] and all((b.offset, b.shape) in places for _, b in self.holder_blocks())

    def even_rows(self, world_size: int) -> bool:
        """Rank ``h`` of ``world_size`` holds rows ``[h m/P, (h+1) m/P)`` of every column
        (FSDP's ``Shard(0)`` of a matrix whose rows P divides, no replicas): the layout
        FSDP2 packs its reduce-scatter with, so the owner exchange packs results by chunks."""
        return self._even_holders == world_size

    @cached_property
    def _even_holders(self) -> int | None:
        """``n`` when its holders are ranks ``0 .. n - 1`` holding equal runs of whole rows
        in rank order, else None. Kept: one number, asked for every owned unit in every batch."""
        rows, cols = self.matrix
        blocks = list(self.holder_blocks())
        if not blocks or rows % len(blocks):
            return None
        chunk = rows // len(blocks)
        even = all(holder == h and (block.offset, block.shape) == ((h * chunk, 0), (chunk, cols))
                   for h, (holder, block) in enumerate(blocks))
        return len(blocks) if even else None


def block_of(shape: Sequence[int], box: Box | None, dim0: tuple[int, int]) -> Block | None:
    """The block of the unit covering ``dim0`` of a parameter of ``shape`` that a rank
    holding ``box`` has (None: no part of it)."""
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


def owned_costs(units: Sequence[Unit], batch: Iterable[int], world_size: int) -> list[int]:
    """Newton-Schulz flops of the units of ``batch`` each rank owns, for every rank at once."""
    loads = [0] * world_size
    for i in batch:
        loads[units[i].owner] += units[i].cost
    return loads
