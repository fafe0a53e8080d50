"""Helpers of the momentum storage tests, moved out of dmuon/ (used only here)."""

from __future__ import annotations

from dmuon.numerics.momentum_storage import INT8_BLOCK


def row_split_on_blocks(offset: int) -> bool:
    """Whether a shard whose rows start at column ``offset`` of the matrix holds whole blocks: its blocks are then
    the matrix's (``dmuon.numerics.momentum_storage``'s module docstring)."""
    return offset % INT8_BLOCK == 0
