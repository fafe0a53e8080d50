"""Where every block of one batch lies in one rank's exchange buffers: pure, from the
plan, computed once per plan and batch and kept (``dmuon.step.fast_path`` caches them with
its plan), so packing is a few tensor ops per batch and direction instead of a slice
and a copy per block.

The buffers' orders are the plan's (``OwnerPlan.gather_splits``/``scatter_splits``); the
owner's *whole* buffer holds its owned matrices one after another, each its sources'
blocks by offset.

Where every owned unit is cut into runs of whole rows (FSDP's ``Shard(0)``, experts, heads),
each block is a range of its matrix, so the whole buffer is the receive buffer's blocks
permuted; blocks of columns (TP's ``Shard(1)``) are not, and are packed block by block.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from dmuon.plan.owner_plan import OwnerPlan
from dmuon.plan.units import Unit

# The most elements the gather packs with one list op: the look-ahead it computes for
# them (in the parameters' dtype) lives until they are packed, so this bounds that
# scratch (``dmuon.tools.dry_run.memory_bound``). A larger block is packed alone.
PACK_CHUNK_NUMEL = 1 << 24


@dataclass(frozen=True)
class BatchLayout:
    """One rank's view of one batch's four buffers (see the module docstring)."""

    send_units: tuple[int, ...]
    """Units whose block this rank sends, in gather send order."""
    send_chunks: tuple[tuple[int, int, int, int], ...]
    """``(first, stop, offset, end)``: ``send_units[first:stop]`` pack into ``send[offset:end]``."""
    owned: tuple[int, ...]
    """Travelling units this rank owns, in the whole buffer's order: by column count,
    then batch order, so the matrices of one column count are cut with one view and one
    split."""
    owned_numels: tuple[int, ...]
    owned_in_batch_order: tuple[int, ...]
    """The same units in batch order (the order of their blocks within a peer's part of a
    buffer)."""
    column_groups: tuple[tuple[int, int, tuple[int, ...]], ...]
    """``(numel, columns, rows of each matrix)`` of each run of ``owned`` of one column count."""
    rows_only: bool
    """Every owned unit's blocks are runs of whole rows (and every holder's block is a
    source's): the fast packing below applies."""
    even_rows: bool
    """Every owned unit is cut into equal row chunks, one per rank (``Unit.even_rows``):
    the results are packed chunk by chunk straight into the scatter's send buffer."""
    whole_sizes: tuple[int, ...]
    """Elements of each source block in whole-buffer order."""
    gather_recv_sizes: tuple[int, ...]
    """Elements of each block of the gather's receive buffer, in its order."""
    gather_recv_to_whole: tuple[int, ...]
    """For each received block, its index in whole-buffer order."""
    scatter_send_sizes: tuple[int, ...]
    scatter_send_from_whole: tuple[int, ...]
    """For each block of the scatter's send buffer, the whole-buffer block it copies."""
    scatter_recv_units: tuple[int, ...]
    """Units whose result block this rank receives, in scatter receive order."""
    scatter_recv_sizes: tuple[int, ...]

    @property
    def send_numel(self) -> int:
        """Elements of the gather's send buffer."""
        return self.send_chunks[-1][3] if self.send_chunks else 0


def by_owner(plan: OwnerPlan, units: Sequence[int]) -> list[int]:
    """``units`` by owner rank, batch order within an owner (the buffers' order)."""
    return sorted(units, key=lambda i: plan.units[i].owner)  # stable


def make_batch_layout(plan: OwnerPlan, batch: Sequence[int], rank: int,
                      pack_key: Callable[[int], Hashable] = lambda param: None) -> BatchLayout:
    """The layout of ``batch`` on ``rank``. ``pack_key(param)`` (say, the parameter's
    dtype) keeps blocks of different keys out of one packing op."""
    units = plan.units
    travelling = plan.travelling(batch)
    send_units = by_owner(plan, [i for i in travelling if units[i].is_source(rank)])
    in_batch_order = [i for i in travelling if units[i].owner == rank]
    owned = sorted(in_batch_order, key=lambda i: units[i].matrix[1])  # stable: batch order within
    whole = [(i, source) for i in owned for source in units[i].sources_by_offset]
    position = {key: k for k, key in enumerate(whole)}
    recv = [(i, s) for s in range(plan.world_size) for i in in_batch_order if units[i].is_source(s)]
    rows_only = all(units[i].rows_only for i in owned)
    scatter_send = [(i, d) for d in range(plan.world_size) for i in in_batch_order if units[i].block(d)]
    receive = by_owner(plan, [i for i in travelling if units[i].block(rank)])
    return BatchLayout(
        send_units=tuple(send_units),
        send_chunks=_chunks([units[i].block_numel(rank) for i in send_units],
                            [pack_key(units[i].param) for i in send_units]),
        owned=tuple(owned),
        owned_numels=tuple(units[i].numel for i in owned),
        owned_in_batch_order=tuple(in_batch_order),
        column_groups=_column_groups([units[i].matrix for i in owned]),
        rows_only=rows_only,
        even_rows=bool(in_batch_order) and all(units[i].even_rows(plan.world_size) for i in in_batch_order),
        whole_sizes=tuple(units[i].block_numel(s) for i, s in whole),
        gather_recv_sizes=tuple(units[i].block_numel(s) for i, s in recv),
        gather_recv_to_whole=tuple(position[key] for key in recv),
        scatter_send_sizes=tuple(units[i].block_numel(d) for i, d in scatter_send),
        scatter_send_from_whole=_from_whole(units, scatter_send, position) if rows_only else (),
        scatter_recv_units=tuple(receive),
        scatter_recv_sizes=tuple(units[i].block_numel(rank) for i in receive),
    )


def _from_whole(units: Sequence[Unit], scatter_send: list[tuple[int, int]], position: dict[tuple[int, int], int]
                ) -> tuple[int, ...]:
    """For each ``(unit, holder)`` block of the scatter's send buffer, the whole-buffer block
    it copies: the lowest source whose block is the holder's (itself, or its twin in the
    owner's replica), from one map of places per unit (not O(P^2) lookups)."""
    sources: dict[int, dict[tuple[tuple[int, int], tuple[int, int]], int]] = {}
    for i in dict.fromkeys(i for i, _ in scatter_send):
        places: dict[tuple[tuple[int, int], tuple[int, int]], int] = {}
        for source, block in units[i].source_blocks():
            places.setdefault((block.offset, block.shape), source)
        sources[i] = places
    return tuple(position[(i, sources[i][units[i].place(d)])] for i, d in scatter_send)


def _column_groups(matrices: Sequence[tuple[int, int]]) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    groups: list[tuple[int, int, list[int]]] = []
    for rows, cols in matrices:
        if not groups or groups[-1][1] != cols:
            groups.append((0, cols, []))
        numel, _, heights = groups[-1]
        groups[-1] = (numel + rows * cols, cols, heights + [rows])
    return tuple((numel, cols, tuple(heights)) for numel, cols, heights in groups)


def _chunks(sizes: Sequence[int], keys: Sequence[Hashable]) -> tuple[tuple[int, int, int, int], ...]:
    """Consecutive runs of one key holding at most ``PACK_CHUNK_NUMEL`` elements (or one block)."""
    chunks = []
    first = offset = 0
    numel = 0
    for k, size in enumerate(sizes):
        if k > first and (keys[k] != keys[first] or numel + size > PACK_CHUNK_NUMEL):
            chunks.append((first, k, offset, offset + numel))
            first, offset, numel = k, offset + numel, 0
        numel += size
    if sizes:
        chunks.append((first, len(sizes), offset, offset + numel))
    return tuple(chunks)
