"""Who orthogonalizes which matrix, and which rows travel where.

Pure functions of shapes, placements and world sizes: no process group is touched,
so everything here is testable without processes.

The fast path handles matrices row-sharded across one mesh dimension (FSDP2's
``Shard(0)``): rank ``r`` holds rows ``[start_r, end_r)`` of every matrix, split the
way ``torch.chunk`` splits (FSDP2's rule: uneven, possibly empty on the last ranks).
Each matrix gets one *owner* rank. In one batch, every rank sends its rows of each
matrix to that matrix's owner (one ``all_to_all_single``), owners orthogonalize, and
the rows go back the same way (a second ``all_to_all_single``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dmuon.newton_schulz import newton_schulz_flops

# How a Muon parameter reaches Newton-Schulz.
LOCAL = "local"  # the rank already holds the whole matrix: plain tensor or Replicate
ALL_TO_ALL = "all_to_all"  # fast path: 1-D mesh, Shard(0), owner-computed
REDISTRIBUTE = "redistribute"  # reference path: all-gather to every rank, slice back
COMM_CHOICES = (ALL_TO_ALL, REDISTRIBUTE)

# A batch holds at most this many matrix elements (all matrices together) unless a
# single matrix is larger. It bounds the bf16 buffers each rank holds at once (about
# 2 * 2 bytes * this / world_size) and lets a batch's Newton-Schulz overlap the next
# batch's communication.
DEFAULT_BATCH_NUMEL = 1 << 27


def comm_path(param: torch.Tensor, comm: str) -> str:
    """Which path a Muon parameter takes, given ``comm`` (``"all_to_all"`` or ``"redistribute"``).

    Raises ``ValueError`` for placements no optimizer step can use (``Partial``).
    """
    if not isinstance(param, DTensor):
        return LOCAL
    placements = param.placements
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"a Partial placement {placements} cannot hold a parameter")
    if all(isinstance(p, Replicate) for p in placements):
        return LOCAL
    fast = (
        comm == ALL_TO_ALL
        and param.device_mesh.ndim == 1
        # exactly Shard(0): _StridedShard (FSDP + TP) subclasses Shard and reorders rows
        and type(placements[0]) is Shard
        and placements[0].dim == 0
    )
    if fast and param.device_mesh.size() == 1:
        return LOCAL
    return ALL_TO_ALL if fast else REDISTRIBUTE


def shard_rows(num_rows: int, world_size: int) -> tuple[int, ...]:
    """Rows each rank holds under ``Shard(0)`` (``torch.chunk``'s split, as FSDP2 uses).

    ``shard_rows(10, 4) == (3, 3, 3, 1)`` and ``shard_rows(3, 4) == (1, 1, 1, 0)``.
    """
    chunk = -(-num_rows // world_size)  # ceil division
    return tuple(max(0, min(num_rows, (r + 1) * chunk) - r * chunk) for r in range(world_size))


def assign_owners(costs: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Balance costs over ranks: longest job first, each to the least-loaded rank.

    Ties (equal cost, equal load) go to the lower index and the lower rank, so every
    rank computes the same assignment. For equal costs this is round-robin.
    """
    owners = [0] * len(costs)
    loads = [(0, rank) for rank in range(world_size)]  # min-heap of (load, rank)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return tuple(owners)


def split_into_batches(numels: Sequence[int], max_batch_numel: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive runs of matrix indices with at most ``max_batch_numel`` elements each
    (a single larger matrix forms a batch of its own)."""
    batches: list[tuple[int, ...]] = []
    current: list[int] = []
    total = 0
    for index, numel in enumerate(numels):
        if current and total + numel > max_batch_numel:
            batches.append(tuple(current))
            current, total = [], 0
        current.append(index)
        total += numel
    if current:
        batches.append(tuple(current))
    return tuple(batches)


@dataclass(frozen=True)
class MatrixLayout:
    """A row-sharded matrix (or stack of matrices) as the plan sees it."""

    shape: tuple[int, ...]
    """Global shape; dim 0 is the sharded one."""
    rows: tuple[int, ...]
    """Rows of dim 0 held by each rank, in rank order."""

    @property
    def row_numel(self) -> int:
        """Elements in one row of dim 0."""
        numel = 1
        for size in self.shape[1:]:
            numel *= size
        return numel


@dataclass(frozen=True)
class OwnerPlan:
    """Owners and batches for the row-sharded Muon matrices of one 1-D mesh."""

    world_size: int
    layouts: tuple[MatrixLayout, ...]
    owners: tuple[int, ...]
    """Owner rank of each matrix."""
    batches: tuple[tuple[int, ...], ...]
    """Matrix indices of each batch; each batch is one gather and one scatter."""

    def gather_splits(self, matrices: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        """Element counts ``(send, recv)`` per peer rank for gathering ``matrices`` to owners.

        Send buffer layout: by destination rank, then in ``matrices`` order, this rank's
        rows of each matrix that destination owns. Receive layout: by source rank, then
        in ``matrices`` order, the source's rows of each matrix this rank owns.
        The scatter back uses the same counts with send and receive swapped.
        """
        send = [0] * self.world_size
        recv = [0] * self.world_size
        for index in matrices:
            layout, owner = self.layouts[index], self.owners[index]
            send[owner] += layout.rows[rank] * layout.row_numel
            if owner == rank:
                for peer in range(self.world_size):
                    recv[peer] += layout.rows[peer] * layout.row_numel
        return send, recv

    def bytes_sent(self, rank: int, element_size: int = 2) -> int:
        """Bytes this rank sends to other ranks in one full step (gathers and scatters)."""
        total = 0
        for batch in self.batches:
            send, recv = self.gather_splits(batch, rank)
            # Scatter sends what the gather received; nothing counts for oneself.
            total += sum(send) - send[rank] + sum(recv) - recv[rank]
        return total * element_size


def make_owner_plan(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    ns_steps: int,
    max_batch_numel: int = DEFAULT_BATCH_NUMEL,
) -> OwnerPlan:
    """Plan owners and batches for matrices of ``shapes`` row-sharded over ``world_size`` ranks.

    Ownership is balanced by Newton-Schulz flops within each batch, so every batch keeps
    all ranks equally busy.
    """
    layouts = tuple(MatrixLayout(tuple(s), shard_rows(s[0], world_size)) for s in shapes)
    batches = split_into_batches([s[0] * l.row_numel for s, l in zip(shapes, layouts)], max_batch_numel)
    owners = [0] * len(layouts)
    for batch in batches:
        costs = [newton_schulz_flops(layouts[i].shape, ns_steps) for i in batch]
        for index, owner in zip(batch, assign_owners(costs, world_size)):
            owners[index] = owner
    return OwnerPlan(world_size, layouts, tuple(owners), batches)
