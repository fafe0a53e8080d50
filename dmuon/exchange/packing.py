"""Fill and drain the owner exchange's buffers (``dmuon.exchange.comm``) with a few ops per
batch and direction, from a :class:`~dmuon.plan.pack_layout.BatchLayout` made once per plan:
the gather's send buffer is one ``_chunk_cat`` per chunk (:func:`stages_casts`); its
receive buffer one ``split``, one of the owner's whole buffer and one ``_foreach_copy_``
between them; the scatter's send buffer the results flattened once (``_chunk_cat``), then
split, permuted and copied the same way; its receive buffer one ``split``. A batch whose
owned matrices are cut into columns (``BatchLayout.rows_only`` False) is copied block by
block. Packing is copies only, so every packing gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dmuon.exchange.comm import WIRE_DTYPE, ScratchMeter, free, track
from dmuon.plan.owner_plan import OwnerPlan
from dmuon.plan.pack_layout import BatchLayout, make_batch_layout
from dmuon.plan.units import Block
from dmuon.torch_compat import chunk_cat

# ``blocks_of(units)``: this rank's blocks of ``units`` (one dtype, any shapes), in order.
BlocksOf = Callable[[Sequence[int]], list[torch.Tensor]]


def pack_gather(plan: OwnerPlan, batch: Sequence[int], rank: int, blocks_of: BlocksOf, device: torch.device,
                meter: ScratchMeter | None = None, layout: BatchLayout | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The gather's send buffer: this rank's block of each unit it sources, by owner,
    then batch order, made chunk by chunk (``PACK_CHUNK_NUMEL``) so only one chunk's
    blocks are in hand at once. With ``out`` (on ``device``), packed into it."""
    layout = layout or make_batch_layout(plan, batch, rank)
    total = layout.send_numel
    send = out if out is not None else track(meter, torch.empty(total, dtype=WIRE_DTYPE, device=device))
    for first, stop, start, end in layout.send_chunks:
        blocks = blocks_of(layout.send_units[first:stop])
        target = send if end - start == total else send[start:end]
        if blocks[0].dtype == WIRE_DTYPE or not stages_casts(device):
            chunk_cat(blocks, target)
            del blocks  # let go before the next chunk's are made: one chunk's look-ahead alive at a time
            continue
        # Flattened in their own dtype first (one kernel), then cast as a whole (one more):
        # flattening and casting at once is one copy per block on CUDA.
        stage = torch.empty(end - start, dtype=blocks[0].dtype, device=device)
        chunk_cat(blocks, stage)
        del blocks
        target.copy_(stage)
    return send


def stages_casts(device: torch.device) -> bool:
    """Whether the gather flattens a chunk in the parameters' dtype and casts it in a second
    op: on accelerators, whose ``_chunk_cat`` runs one kernel only without a cast (CUDA's
    falls back to one ``copy_`` per block); the CPU casts while it flattens, in one op."""
    return device.type not in ("cpu", "meta")


def gather_whole(plan: OwnerPlan, layout: BatchLayout, recv: torch.Tensor, meter: ScratchMeter | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The owner's whole buffer (tracked by ``meter``; free it once its matrices are
    used) and each owned matrix, a view of it, from the gather's receive buffer."""
    whole = track(meter, recv.new_empty(sum(layout.owned_numels)))
    matrices = dict(zip(layout.owned, _matrices(whole, layout)))
    if layout.rows_only:
        if layout.whole_sizes:
            targets = whole.split(layout.whole_sizes)
            torch._foreach_copy_([targets[k] for k in layout.gather_recv_to_whole],
                                 list(recv.split(layout.gather_recv_sizes)))
        return whole, matrices
    offset = 0
    for source in range(plan.world_size):
        for i in layout.owned_in_batch_order:
            unit = plan.units[i]
            if unit.is_source(source):
                block = unit.block(source)
                _region(matrices[i], block).copy_(recv[offset : offset + block.numel].view(block.shape))
                offset += block.numel
    return whole, matrices


def _matrices(whole: torch.Tensor, layout: BatchLayout) -> list[torch.Tensor]:
    """The owned matrices, views of ``whole``: per run of one column count, one view and one
    split."""
    groups = layout.column_groups
    parts = whole.split([numel for numel, _, _ in groups]) if len(groups) > 1 else [whole]
    return [matrix for part, (_, cols, heights) in zip(parts, groups)
            for matrix in part.view(-1, cols).split(heights)]


def pack_scatter(plan: OwnerPlan, batch: Sequence[int], rank: int, results: dict[int, torch.Tensor],
                 device: torch.device, meter: ScratchMeter | None = None,
                 layout: BatchLayout | None = None) -> torch.Tensor:
    """The scatter's send buffer: by holder rank, then batch order, that rank's block
    of each result this rank owns. Consumes ``results`` (emptied, and freed in
    ``meter``) as soon as they are copied, before the send buffer is made."""
    layout = layout or make_batch_layout(plan, batch, rank)
    size = sum(layout.scatter_send_sizes)
    if layout.even_rows:  # FSDP's layout: chunk h of every result goes to rank h
        send = track(meter, torch.empty(size, dtype=WIRE_DTYPE, device=device))
        chunk_cat([results[i] for i in layout.owned_in_batch_order], send, plan.world_size)
        _release(results, meter)
        return send
    if not layout.rows_only:
        send = track(meter, torch.empty(size, dtype=WIRE_DTYPE, device=device))
        offset = 0
        for dest in range(plan.world_size):
            for i in layout.owned_in_batch_order:
                block = plan.units[i].block(dest)
                if block:
                    send[offset : offset + block.numel].view(block.shape).copy_(_region(results[i], block))
                    offset += block.numel
        _release(results, meter)
        return send
    flat = track(meter, torch.empty(sum(layout.owned_numels), dtype=WIRE_DTYPE, device=device))
    if layout.owned:
        chunk_cat([results[i] for i in layout.owned], flat)
    _release(results, meter)
    send = track(meter, torch.empty(size, dtype=WIRE_DTYPE, device=device))
    if layout.owned:
        sources = flat.split(layout.whole_sizes)
        torch._foreach_copy_(list(send.split(layout.scatter_send_sizes)),
                             [sources[k] for k in layout.scatter_send_from_whole])
    free(meter, flat)
    return send


def _release(results: dict[int, torch.Tensor], meter: ScratchMeter | None) -> None:
    for result in results.values():
        free(meter, result)
    results.clear()


def scatter_blocks(layout: BatchLayout, recv: torch.Tensor) -> list[torch.Tensor]:
    """This rank's block of each unit in ``layout.scatter_recv_units``: flat views of ``recv``."""
    return list(recv.split(layout.scatter_recv_sizes)) if layout.scatter_recv_units else []


def _region(matrix: torch.Tensor, block: Block) -> torch.Tensor:
    """The view of a unit's whole matrix that ``block`` covers."""
    (row, col), (rows, cols) = block.offset, block.shape
    return matrix[row : row + rows, col : col + cols]
