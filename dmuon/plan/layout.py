"""Which part of a parameter each rank holds, from its mesh and placements alone.

Pure: a :class:`Layout` is plain data, so the planner and ``plan_report`` can ask it
about any rank of any mesh without a process group.

DTensor's rules, applied left to right over the mesh dims (as
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` does):

- ``Replicate()``: every rank of that mesh dim holds the same part;
- ``Shard(d)``: the indices held so far along dim ``d`` are cut the way
  ``torch.chunk`` cuts (equal ceil-sized chunks, the last ones short or empty), and
  the rank keeps its chunk;
- ``_StridedShard(d, split_factor=k)`` (FSDP2 over a TP-sharded weight): the indices
  held so far are first cut into ``k`` pieces, each piece is cut into chunks, and
  the rank keeps its chunk of every piece. Combined with the TP ``Shard`` that
  follows, each rank again holds one contiguous range ("TP first, then FSDP").

A rank's part is a *box* when, along every dim, its indices form one contiguous range:
then its local tensor is ``global[box]``. Every layout TorchTitan builds gives boxes; the
owner exchange moves boxes, anything else takes the reference path.

Memory: a plan rank's optimizer keeps its plan, so what is kept per rank of the mesh
must stay small at P = 1024: boxes in a shared :class:`BoxTable`, and a rank's replica
and mesh position computed from its coordinates, not stored per rank and parameter.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from dmuon.torch_compat import StridedShard

Range = tuple[int, int]
"""``(start, length)`` along one dim."""
Box = tuple[Range, ...]
"""One ``(start, length)`` per dim of the global tensor."""


def chunk_range(length: int, chunks: int, index: int) -> Range:
    """``(offset, size)`` of chunk ``index`` of ``chunks`` chunks of ``length``, as
    ``torch.chunk`` (and DTensor's ``Shard``) cuts: equal ceil-sized chunks, the last
    ones short or empty."""
    size = -(-length // chunks)
    return min(length, index * size), max(0, min(length, (index + 1) * size) - index * size)


def chunk_ranges(length: int, chunks: int) -> list[Range]:
    """Every chunk: ``chunk_ranges(10, 4) == [(0, 3), (3, 3), (6, 3), (9, 1)]``."""
    return [chunk_range(length, chunks, c) for c in range(chunks)]


def _take(indices: list[Range], offset: int, size: int) -> list[Range]:
    """Positions ``[offset, offset + size)`` of the index list ``indices`` (ranges of
    global indices, concatenated in order)."""
    taken, position = [], 0
    for start, length in indices:
        lo, hi = max(offset, position), min(offset + size, position + length)
        if lo < hi:
            taken.append((start + lo - position, hi - lo))
        position += length
    return taken


def local_indices(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
                  coordinate: Sequence[int]) -> list[list[Range]]:
    """The global indices the rank at ``coordinate`` holds, per dim, as ordered ranges.

    (``_StridedShard`` is not a ``Shard`` subclass in torch 2.13: both are named.)
    """
    held: list[list[Range]] = [[(0, size)] for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Partial) or not isinstance(placement, (Shard, StridedShard)):
            raise ValueError(f"no layout for placement {placement}")
        dim, chunks, mine = placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        total = sum(length for _, length in held[dim])
        pieces = chunk_ranges(total, placement.split_factor) if isinstance(placement, StridedShard) else [(0, total)]
        kept: list[Range] = []
        for piece_start, piece_length in pieces:
            offset, size = chunk_range(piece_length, chunks, mine)
            kept += _take(held[dim], piece_start + offset, size)
        held[dim] = kept
    return held


def as_box(indices: list[list[Range]]) -> Box | None:
    """The indices as a box, or None when some dim's indices are not one contiguous range."""
    box = []
    for ranges in indices:
        ranges = [r for r in ranges if r[1]]
        if not ranges:
            box.append((0, 0))
            continue
        start = ranges[0][0]
        if any(r[0] != start + sum(length for _, length in ranges[:i]) for i, r in enumerate(ranges)):
            return None
        box.append((start, sum(length for _, length in ranges)))
    return tuple(box)


@dataclass(frozen=True)
class Layout:
    """A parameter's mesh and placements, with the plan rank at each mesh position."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    ranks: tuple[int, ...] | None = None
    """Plan rank at each mesh position, row-major; None: ``0 .. mesh size - 1``."""

    @staticmethod
    def sharded(world_size: int, dim: int = 0) -> Layout:
        """A 1-D mesh of ``world_size`` ranks with ``Shard(dim)`` (FSDP2 is ``dim = 0``)."""
        return Layout((world_size,), (Shard(dim),))

    @staticmethod
    def hsdp(replicas: int, shards: int, dim: int = 0) -> Layout:
        """``(dp_replicate, dp_shard)`` with ``(Replicate(), Shard(dim))``."""
        return Layout((replicas, shards), (Replicate(), Shard(dim)))

    @cached_property
    def size(self) -> int:
        return math.prod(self.mesh_shape)

    @cached_property
    def mesh_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.size)) if self.ranks is None else self.ranks

    def coordinates(self) -> list[tuple[int, ...]]:
        """Mesh coordinates in row-major order (the order of ``mesh_ranks``)."""
        return list(itertools.product(*(range(n) for n in self.mesh_shape)))

    def boxes(self, shape: Sequence[int]) -> BoxTable:
        """Plan rank -> the box it holds of a tensor of ``shape`` (None: not a box), in
        mesh order. Cached: a model repeats a few shapes many times."""
        return _boxes(self, tuple(shape))

    @cached_property
    def has_replicas(self) -> bool:
        """Whether some mesh dim replicates the parameter (HSDP's ``dp_replicate``)."""
        return any(isinstance(p, Replicate) for p in self.placements)

    def replica(self) -> dict[int, tuple[int, ...]]:
        """Plan rank -> its coordinates on the ``Replicate`` mesh dims: ranks that
        differ only there hold the same box (one *replica* of the parameter each)."""
        return {rank: self.replica_at(position) for position, rank in enumerate(self.mesh_ranks)}

    def position(self, rank: int) -> int:
        """Where ``rank`` sits in the mesh (row-major); ``KeyError`` when it is not in it."""
        positions = self._positions
        if positions is not None:
            return positions[rank]
        try:
            position = operator.index(rank)
        except TypeError:
            raise KeyError(rank) from None
        if not 0 <= position < self.size:
            raise KeyError(rank)
        return position

    def replica_of(self, rank: int) -> tuple[int, ...] | None:
        """:meth:`replica` for one rank, in O(mesh dims); None when it is not in the mesh."""
        try:
            return self.replica_at(self.position(rank))
        except KeyError:
            return None

    def replica_at(self, position: int) -> tuple[int, ...]:
        """The replica of the rank at mesh ``position``."""
        return tuple(position // stride % size for stride, size in self._replicated_strides)

    @cached_property
    def sorted_ranks(self) -> tuple[int, ...]:
        """The mesh's plan ranks, sorted (shared by every unit that any of them may own)."""
        ranks = self.mesh_ranks
        return ranks if self._positions is None else tuple(sorted(ranks))

    def replica_keys(self) -> list[tuple[int, ...]]:
        """Every replica, sorted."""
        return list(itertools.product(*(range(self.mesh_shape[i]) for i in self._replicated_dims)))

    def members(self, replica: tuple[int, ...]) -> tuple[int, ...]:
        """The sorted plan ranks of one replica: one tuple per replica, made once and shared."""
        members = self._members.get(replica)
        if members is None:
            members = self._members[replica] = tuple(r for r in self.sorted_ranks if self.replica_of(r) == replica)
        return members

    @cached_property
    def _members(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        return {}

    @cached_property
    def _replicated_dims(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Replicate))

    @cached_property
    def _replicated_strides(self) -> tuple[tuple[int, int], ...]:
        """``(stride, size)`` of each ``Replicate`` mesh dim in row-major positions."""
        return tuple((math.prod(self.mesh_shape[i + 1:]), self.mesh_shape[i]) for i in self._replicated_dims)

    @cached_property
    def _positions(self) -> dict[int, int] | None:
        """Plan rank -> mesh position; None where they are equal (no map kept: the usual
        case, ranks ``0 .. P - 1`` in mesh order)."""
        if self.ranks is None or self.ranks == tuple(range(self.size)):
            return None
        return {rank: position for position, rank in enumerate(self.ranks)}


class BoxTable(Mapping):
    """Every plan rank's box of one tensor shape on one layout (a ``Mapping`` rank ->
    box, in mesh order), kept as one start and one length array per tensor dim: about
    ``16 * ndim`` bytes per rank, not a tuple of tuples per rank."""

    def __init__(self, layout: Layout, shape: tuple[int, ...]) -> None:
        self.layout, self.shape = layout, shape
        self._starts = [array("q") for _ in shape]
        self._lengths = [array("q") for _ in shape]
        self._not_boxes: set[int] = set()  # positions whose indices are not one range per dim
        for position, coordinate in enumerate(layout.coordinates()):
            box = as_box(local_indices(shape, layout.mesh_shape, layout.placements, coordinate))
            if box is None:
                self._not_boxes.add(position)
                box = tuple((0, 0) for _ in shape)
            for d, (start, length) in enumerate(box):
                self._starts[d].append(start)
                self._lengths[d].append(length)

    def __getitem__(self, rank: int) -> Box | None:
        return self.at(self.layout.position(rank))

    def at(self, position: int) -> Box | None:
        """The box of the rank at mesh ``position``."""
        if position in self._not_boxes:
            return None
        return tuple((starts[position], lengths[position]) for starts, lengths in zip(self._starts, self._lengths))

    def numel_at(self, position: int, rows: tuple[int, int]) -> int:
        """Elements of the rank at mesh ``position`` within rows ``[start, stop)`` of dim 0
        (0 for a part that is not a box): its block's size, without making the block."""
        start = self._starts[0][position]
        count = min(start + self._lengths[0][position], rows[1]) - max(start, rows[0])
        if count <= 0:
            return 0
        for lengths in self._lengths[1:]:
            count *= lengths[position]
        return count

    def __iter__(self) -> Iterator[int]:
        return iter(self.layout.mesh_ranks)

    def __len__(self) -> int:
        return self.layout.size

    @property
    def all_boxes(self) -> bool:
        """Whether every rank's part is a box."""
        return not self._not_boxes


@functools.lru_cache(maxsize=64)  # distinct (layout, shape) box tables kept: each holds O(P) integers
def _boxes(layout: Layout, shape: tuple[int, ...]) -> BoxTable:
    return BoxTable(layout, shape)
