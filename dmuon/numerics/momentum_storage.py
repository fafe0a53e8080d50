"""Muon's momentum held in less than the parameter's dtype (issue 51): bf16, or int8 with one
fp32 scale per block of :data:`INT8_BLOCK` consecutive elements of a row.

The momentum rule stays the one in ``dmuon.numerics.update_lists``; what changes is where its
result is kept between steps. Each step reads the stored momentum back as the parameter's
dtype (:func:`read_momenta`, :func:`dequantize_int8`), runs the EMA there, and rounds the
result into the store (:func:`store_momenta_`, :func:`quantize_int8`), so the update of the
step sees the EMA before it is rounded and only what the next step reads has been rounded once.

Why blocks along a row, and why that keeps DMuon exact across world sizes: every scale is
read from, and applies to, the elements of one block of one row of the matrix (for ``[E, A,
B]`` experts, of one expert; for a 4-D+ weight, of the ``[O, rest]`` matrix's rows). A rank
holding whole rows (FSDP's ``Shard(0)``, HSDP, EP, uneven or empty shards) holds whole blocks,
and quantizing its rows gives the bits quantizing the whole matrix gives for them. A layout
that splits a row (TP's ``Shard(1)``) keeps that property only where each shard starts on a
block boundary (:func:`row_split_on_blocks`).

int8, per block ``x`` of at most :data:`INT8_BLOCK` elements (the last block of a row may be
shorter)::

    scale = max(|x|) / 127           # fp32; 0 for a block of zeros
    q     = round(x / scale)         # round half to even, in [-127, 127]; 0 where scale is 0
    x'    = q * scale                # what the next step reads

Block size 128: the scale adds 4 / 128 = 0.03 bytes per element (1.03 bytes in all, a
quarter of fp32's 4 and within the 1.05 the issue allows), and one outlier in a block costs
the resolution of 127 other elements at most; 256 would save 0.016 bytes an element for
twice the reach of an outlier. The common hidden sizes (multiples of 128) split into whole
blocks, so a TP degree that splits them in equal parts of a multiple of 128 columns keeps
every block whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dmuon.numerics.masked_updates import select_

# The momentum dtypes a group can choose (``momentum_dtype``): None keeps the parameter's.
MOMENTUM_DTYPES = (None, "bfloat16", "int8")
# Elements per fp32 scale along the last dim of a row (module docstring: why 128).
INT8_BLOCK = 128
# The largest magnitude an int8 value takes: symmetric, so -x quantizes to -q.
INT8_MAX = 127


def parse_momentum_dtype(value: object) -> str | None:
    """``value`` as one of :data:`MOMENTUM_DTYPES` (``torch.bfloat16`` reads as ``"bfloat16"``);
    ValueError naming the allowed values otherwise."""
    if value is torch.bfloat16:
        return "bfloat16"
    if value in MOMENTUM_DTYPES:
        return value  # type: ignore[return-value]
    raise ValueError(f"momentum_dtype must be one of None (the parameter's dtype), torch.bfloat16 or 'bfloat16', "
                     f"or 'int8' (block-wise, {INT8_BLOCK} elements a scale); got {value!r}")


def blocks_per_row(columns: int) -> int:
    """How many scales a row of ``columns`` elements has."""
    return -(-columns // INT8_BLOCK)


def scales_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the fp32 scales of an int8 momentum of ``shape`` (a 1-D tensor is one row)."""
    return (*shape[:-1], blocks_per_row(shape[-1])) if len(shape) else (1,)


def row_split_on_blocks(offset: int) -> bool:
    """Whether a shard whose rows start at column ``offset`` of the matrix holds whole blocks:
    its blocks are then the matrix's (module docstring)."""
    return offset % INT8_BLOCK == 0


def bytes_per_element(shape: Sequence[int], momentum_dtype: str | None, param_dtype: torch.dtype) -> float:
    """The momentum's bytes per element of a tensor of ``shape`` (scales included)."""
    if momentum_dtype is None:
        return float(param_dtype.itemsize)
    if momentum_dtype == "bfloat16":
        return 2.0
    numel = math.prod(shape)
    return (numel + 4 * math.prod(scales_shape(shape))) / max(numel, 1)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[..., columns]``, fp32) as ``[..., blocks, INT8_BLOCK]``, the last block of each
    row padded with zeros (which change no block's maximum)."""
    columns = x.shape[-1]
    padded = blocks_per_row(columns) * INT8_BLOCK
    if padded != columns:
        x = torch.nn.functional.pad(x, (0, padded - columns))
    return x.reshape(*x.shape[:-1], padded // INT8_BLOCK, INT8_BLOCK)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any float dtype, ``[..., columns]``; a 0-dim or 1-D tensor is one row) as int8
    values of its shape and fp32 scales of :func:`scales_shape`, block by block of each row
    (module docstring). New tensors; ``x`` is read once."""
    shape = x.shape
    rows = x.reshape(1, -1) if x.ndim < 2 else x
    blocks = _blocks(rows.to(torch.float32))
    scales = blocks.abs().amax(dim=-1, keepdim=True).div_(INT8_MAX)
    values = torch.where(scales > 0, blocks / scales, 0.0).round_().clamp_(-INT8_MAX, INT8_MAX)
    values = values.to(torch.int8).reshape(*rows.shape[:-1], blocks.shape[-2] * INT8_BLOCK)[..., : rows.shape[-1]]
    return values.reshape(shape).contiguous(), scales.squeeze(-1).reshape(scales_shape(shape))


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values * scale`` block by block, as a new tensor of ``dtype`` and ``values``' shape
    (computed in fp32, then cast: exact for fp32, one rounding for bf16)."""
    shape = values.shape
    rows = values.reshape(1, -1) if values.ndim < 2 else values
    blocks = _blocks(rows.to(torch.float32))
    out = blocks.mul_(scales.reshape(*blocks.shape[:-1], 1))
    out = out.reshape(*rows.shape[:-1], blocks.shape[-2] * INT8_BLOCK)[..., : rows.shape[-1]]
    return out.reshape(shape).to(dtype)


# ----------------------------------------------------------- the step's reads and writes
# A step reads every kept momentum of a parameter list at once (:func:`read_momenta`), runs
# the rule on what it got, and stores the results back (:func:`store_momenta_`). Momenta held
# alike on one device (bf16; int8 whose rows are whole blocks, the usual hidden sizes) are
# read into one flat buffer, so a list costs a few ops, not a dozen per tensor; the others
# one by one. Either way each element gets the bits of :func:`quantize_int8` and
# :func:`dequantize_int8`: the arithmetic is per element and per block.

# Elements a batched store quantizes at once (a multiple of INT8_BLOCK): its fp32
# temporaries stay a few times this, whatever the momenta's size.
ROUNDING_CHUNK_NUMEL = 1 << 22


@dataclass
class MomentumCopies:
    """What :func:`read_momenta` read: the tensors the rule runs on, and how they are stored back
    (:func:`read_together` says which are read together)."""

    working: list[torch.Tensor]
    """Per momentum: its store itself (held in the dtype asked for), or a new tensor."""
    batches: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    """Momenta read together: their indices and the flat buffer their working tensors view."""
    alone: list[int] = field(default_factory=list)
    """Momenta read one by one."""


def read_together(values: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether a kept momentum can join a batch: contiguous, and for int8, rows of whole blocks
    (its flat values, cut every ``INT8_BLOCK``, are its blocks, in the order of its scales)."""
    return values.is_contiguous() and (scales is None or (values.ndim >= 1 and values.shape[-1] % INT8_BLOCK == 0
                                                          and scales.is_contiguous()))


def read_momenta(values: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None],
                 dtypes: Sequence[torch.dtype]) -> MomentumCopies:
    """Each kept momentum (``values``, with its int8 ``scales`` or None) as a tensor of its
    ``dtypes`` entry (the parameter's) to run the momentum rule on: the store itself where it
    is held in that dtype (no copy: the rule updates it in place), else a new tensor (int8
    dequantized, exactly in fp32 then cast; bf16 widened exactly)."""
    copies = MomentumCopies(list(values))
    kinds: dict[tuple, list[int]] = {}
    for k, (store, scale, dtype) in enumerate(zip(values, scales, dtypes)):
        if scale is None and store.dtype == dtype:
            continue
        if read_together(store, scale):
            kinds.setdefault((scale is not None, store.dtype, dtype, store.device), []).append(k)
        else:
            copies.alone.append(k)
            copies.working[k] = (dequantize_int8(store, scale, dtype) if scale is not None else store.to(dtype))
    for (int8, _, dtype, _), members in kinds.items():
        numels = [values[k].numel() for k in members]
        # One concatenation in the kept dtype, then one exact widening (a list copy across
        # dtypes would take one kernel a tensor on CUDA).
        flat = torch.cat([values[k].view(-1) for k in members]).to(torch.float32 if int8 else dtype)
        if int8:
            flat.view(-1, INT8_BLOCK).mul_(torch.cat([scales[k].view(-1) for k in members]).unsqueeze(1))
            flat = flat.to(dtype)
        for k, view in zip(members, flat.split(numels)):
            copies.working[k] = view.view(values[k].shape)
        copies.batches.append((members, flat))
    return copies


def store_momenta_(values: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None], copies: MomentumCopies,
                   oks: Sequence[torch.Tensor] | None = None, foreach: bool = False) -> None:
    """Round each momentum :func:`read_momenta` copied (after the rule) into its store, in
    place; with ``oks`` only where each 0-dim device bool holds (values and scales keep their
    bits elsewhere: selected, not quantized again). A store that is its working tensor was
    updated in place already."""
    targets: list[torch.Tensor] = []
    news: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []

    def put(k: int, new_values: torch.Tensor, new_scales: torch.Tensor | None) -> None:
        for target, new in ((values[k], new_values), (scales[k], new_scales)):
            if target is not None:
                targets.append(target)
                news.append(new.view(target.shape))
                if oks is not None:
                    masks.append(oks[k])

    for k in copies.alone:
        work = copies.working[k]
        put(k, *(quantize_int8(work) if scales[k] is not None else (work.to(values[k].dtype), None)))
    for members, flat in copies.batches:
        numels = [values[k].numel() for k in members]
        if scales[members[0]] is None:
            new_values, new_scales = flat.to(values[members[0]].dtype), None
        else:
            new_values, new_scales = _quantize_flat(flat)
        for k, v, sc in zip(members, new_values.split(numels),
                            new_scales.split([n // INT8_BLOCK for n in numels]) if new_scales is not None
                            else [None] * len(members)):
            put(k, v, sc)
    if not targets:
        return
    if oks is None:
        for dtype in {t.dtype for t in targets}:  # one list per dtype: one kernel each on an accelerator
            torch._foreach_copy_([t for t in targets if t.dtype == dtype], [n for t, n in zip(targets, news)
                                                                          if t.dtype == dtype])
        return
    select_(targets, masks, news, foreach)


def _quantize_flat(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8` of a flat run of whole blocks, chunk by chunk
    (:data:`ROUNDING_CHUNK_NUMEL`): int8 values and fp32 scales, flat."""
    values = torch.empty(flat.numel(), dtype=torch.int8, device=flat.device)
    scales = torch.empty(flat.numel() // INT8_BLOCK, dtype=torch.float32, device=flat.device)
    for start in range(0, flat.numel(), ROUNDING_CHUNK_NUMEL):
        blocks = flat[start : start + ROUNDING_CHUNK_NUMEL].view(-1, INT8_BLOCK).to(torch.float32)
        scale = blocks.abs().amax(dim=-1, keepdim=True).div_(INT8_MAX)
        values[start : start + blocks.numel()].copy_(
            torch.where(scale > 0, blocks / scale, 0.0).round_().clamp_(-INT8_MAX, INT8_MAX).view(-1))
        scales[start // INT8_BLOCK : (start + blocks.numel()) // INT8_BLOCK].copy_(scale.view(-1))
    return values, scales
