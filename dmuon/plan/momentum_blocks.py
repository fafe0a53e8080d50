"""Whether a parameter's layout keeps int8 momentum's blocks whole on every rank
(``dmuon.numerics.momentum_storage``): decided from its placements alone, the same answer
on every rank, so every rank stores a parameter's momentum in one form.

A block is ``INT8_BLOCK`` consecutive elements of one row (a 4-D+ weight's rows are its
``[O, rest]`` matrix's). A layout that never cuts the last dim (FSDP, HSDP, EP, TP's
``Shard(0)``) gives each rank whole rows, hence whole blocks. One that cuts it (TP's
``Shard(1)``) keeps them whole only where every rank's part of a row starts on a block
boundary and its scales, cut by the same placements, are its blocks' scales; otherwise the
momentum is held in bf16 (bf16 rounds each element alone: exact under any cut).
"""

from __future__ import annotations

from collections.abc import Sequence

from dmuon.numerics.momentum_storage import INT8_BLOCK, blocks_per_row, scales_shape
from dmuon.plan.layout import Layout


def cuts_rows(layout: Layout, ndim: int) -> bool:
    """Whether a placement of ``layout`` cuts the rows of an ``ndim``-D tensor: shards its last
    dim, or for a 4-D+ weight (whose rows are ``[O, rest]``'s) any dim but the first."""
    dims = {getattr(p, "dim", None) for p in layout.placements} - {None}
    if ndim > 3:
        return any(d != 0 for d in dims)
    return bool(dims & {ndim - 1, -1})


def int8_blocks_whole(layout: Layout, shape: Sequence[int]) -> bool:
    """Whether every rank of ``layout`` holds whole int8 blocks of a ``shape`` tensor, with
    its scales cut to match (module docstring)."""
    if not cuts_rows(layout, len(shape)):
        return True
    if len(shape) > 3:  # a cut inside [O, rest]'s rows: not worth the bookkeeping; bf16
        return False
    values, scales = layout.boxes(shape), layout.boxes(scales_shape(shape))
    for rank in layout.mesh_ranks:
        box, scale_box = values[rank], scales[rank]
        if box is None or scale_box is None:
            return False
        start, length = box[-1]
        wanted = (start // INT8_BLOCK, blocks_per_row(start + length) - start // INT8_BLOCK) if length else None
        if length and (start % INT8_BLOCK or scale_box[-1] != wanted):
            return False
        if not length and scale_box[-1][1]:
            return False
    return True
