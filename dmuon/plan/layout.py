"""Which part of a parameter each rank holds, from its mesh and placements alone.

Pure: a :class:`Layout` is plain data (mesh shape, placements, and which plan rank
sits at each mesh position), so the planner and ``plan_report`` can ask it about
any rank of any mesh without a process group.

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

A rank's part is a *box* when, along every dim, its indices form one contiguous
range: then its local tensor is ``global[box]``. Every layout TorchTitan builds
gives boxes; the owner exchange moves boxes, and anything else takes the reference
path.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
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


def local_indices(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coordinate: Sequence[int]
) -> list[list[Range]]:
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
        if isinstance(placement, StridedShard):
            pieces = chunk_ranges(total, placement.split_factor)
        else:
            pieces = [(0, total)]
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

    @property
    def size(self) -> int:
        return math.prod(self.mesh_shape)

    @cached_property
    def mesh_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.size)) if self.ranks is None else self.ranks

    def coordinates(self) -> list[tuple[int, ...]]:
        """Mesh coordinates in row-major order (the order of ``mesh_ranks``)."""
        return list(itertools.product(*(range(n) for n in self.mesh_shape)))

    def boxes(self, shape: Sequence[int]) -> dict[int, Box | None]:
        """Plan rank -> the box it holds of a tensor of ``shape`` (None: not a box).
        Cached: a model repeats a few shapes many times."""
        return _boxes(self, tuple(shape))

    @property
    def has_replicas(self) -> bool:
        """Whether some mesh dim replicates the parameter (HSDP's ``dp_replicate``)."""
        return any(isinstance(p, Replicate) for p in self.placements)

    def replica(self) -> dict[int, tuple[int, ...]]:
        """Plan rank -> its coordinates on the ``Replicate`` mesh dims: ranks that
        differ only there hold the same box (one *replica* of the parameter each)."""
        replicated = [i for i, p in enumerate(self.placements) if isinstance(p, Replicate)]
        return {
            rank: tuple(coordinate[i] for i in replicated)
            for rank, coordinate in zip(self.mesh_ranks, self.coordinates())
        }


@functools.lru_cache(maxsize=256)
def _boxes(layout: Layout, shape: tuple[int, ...]) -> dict[int, Box | None]:
    return {
        rank: as_box(local_indices(shape, layout.mesh_shape, layout.placements, coordinate))
        for rank, coordinate in zip(layout.mesh_ranks, layout.coordinates())
    }
