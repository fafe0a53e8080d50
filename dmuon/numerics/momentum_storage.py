"""Muon's momentum held in less than the parameter's dtype (issue 51): bf16, or int8 with one
fp32 scale per block of :data:`INT8_BLOCK` consecutive elements of a row.

The momentum rule stays the one in ``dmuon.numerics.update_rules``; what changes is where its
result is kept between steps. Each step reads the stored momentum back as the parameter's dtype
(:func:`read_momenta`, :func:`dequantize_int8`), runs the EMA there, and rounds the result into
the store (:func:`store_momenta_`, :func:`quantize_int8`), so the update of the step sees the
EMA before it is rounded and only what the next step reads has been rounded once.

Why blocks along a row, and why that keeps DMuon exact across world sizes: every scale is read
from, and applies to, the elements of one block of one row of the matrix (for ``[E, A, B]``
experts, of one expert; for a 4-D+ weight, of the ``[O, rest]`` matrix's rows). A rank holding
whole rows (FSDP's ``Shard(0)``, HSDP, EP, uneven or empty shards) holds whole blocks, and
quantizing its rows gives the bits quantizing the whole matrix gives for them. A layout that splits
a row (TP's ``Shard(1)``) keeps that property only where each shard starts on a block boundary.

int8, per block ``x`` of at most :data:`INT8_BLOCK` elements (the last block of a row may be
shorter)::

    scale = max(|x|) / 127           # fp32, correctly rounded; 0 for a block of zeros
    q     = round(x / scale)         # the fp32 quotient rounded half to even, clamped to
                                     # [-127, 127]; 0 where scale is 0
    x'    = q * scale                # what the next step reads

These are the bits on the CPU and on CUDA alike: both divisions are by device tensors (CUDA
takes a Python-number divisor as a multiplication by its reciprocal, an ulp off the quotient
for some ``max(|x|)``), and on a GPU the quantization takes four passes over the momentum
(:func:`_quantize_blocks_`).

Block size 128: the scale adds 4 / 128 = 0.03 bytes per element (1.03 bytes in all, a quarter of
fp32's 4 and within the 1.05 the issue allows), and one outlier in a block costs the resolution
of 127 other elements at most; 256 would save 0.016 bytes an element for twice the reach of an
outlier. The common hidden sizes (multiples of 128) split into whole blocks, so a TP degree that
splits them in equal parts of a multiple of 128 columns keeps every block whole."""

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
# The narrowest row int8 pays for: a row of w elements costs 1 + 4 / w bytes an element with its
# scale, bf16's 2 or more below 5 (such a momentum is kept in bf16: dmuon.state.kept_state).
INT8_MIN_ROW = 5
# The largest magnitude an int8 value takes: symmetric, so -x quantizes to -q.
INT8_MAX = 127


def parse_momentum_dtype(value: object, name: str = "momentum_dtype") -> str | None:
    """``value`` of the option ``name`` (``momentum_dtype``, or the AdamW part's state dtype) as
    one of :data:`MOMENTUM_DTYPES` (``torch.bfloat16`` reads as ``"bfloat16"``); ValueError
    naming the allowed values otherwise."""
    if value is torch.bfloat16:
        return "bfloat16"
    if value in MOMENTUM_DTYPES:
        return value  # type: ignore[return-value]
    raise ValueError(f"{name} must be one of None (the parameter's dtype), torch.bfloat16 or 'bfloat16', "
                     f"or 'int8' (block-wise, {INT8_BLOCK} elements a scale); got {value!r}")


def blocks_per_row(columns: int) -> int:
    """How many scales a row of ``columns`` elements has."""
    return -(-columns // INT8_BLOCK)


def row_length(shape: Sequence[int]) -> int:
    """The elements of one row of a tensor of ``shape``, the rows its blocks run along
    (:func:`_rows`)."""
    if len(shape) > 3:
        return math.prod(shape[1:])
    return shape[-1] if len(shape) else 1


def scales_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the fp32 scales of an int8 momentum of ``shape``: one per block of each row
    (:func:`_rows`: a 1-D tensor is one row, a 4-D+ weight ``[O, rest]``)."""
    if len(shape) > 3:
        return (shape[0], blocks_per_row(row_length(shape)))
    return (*shape[:-1], blocks_per_row(shape[-1])) if len(shape) else (1,)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the rows its blocks run along: a 0-D or 1-D tensor is one row, a matrix or a
    3-D expert stack ``[E, A, B]`` its own rows, a 4-D+ weight the rows of its ``[O, rest]``
    matrix (the matrix Muon orthogonalizes; blocking its last dim, a 3x3 kernel's 3 elements,
    would cost a scale every 3 elements)."""
    if x.ndim < 2:
        return x.reshape(1, -1)
    return x.reshape(x.shape[0], row_length(x.shape)) if x.ndim > 3 else x  # -1 is ambiguous for an empty shard


def bytes_per_element(shape: Sequence[int], momentum_dtype: str | None,
                      param_dtype: torch.dtype = torch.float32) -> float:
    """The momentum's bytes per element of a tensor of ``shape`` kept in ``momentum_dtype``
    (scales included): 1 + 4 * ceil(w / 128) / w for int8 rows of w elements."""
    if momentum_dtype is None:
        return float(param_dtype.itemsize)
    if momentum_dtype == "bfloat16":
        return 2.0
    numel = math.prod(shape)
    return (numel + 4 * math.prod(scales_shape(shape))) / max(numel, 1)


def _block_views(rows: torch.Tensor, scales: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``rows`` (``[..., columns]``) as views of its blocks, each with the view of ``scales``
    (``[..., blocks_per_row(columns)]``) it has: the whole blocks ``[..., n, INT8_BLOCK]`` and
    the shorter last block of each row ``[..., 1, columns % INT8_BLOCK]`` (a row narrower than
    a block is that one block). Views, not a padded copy: a row of 1 element padded to a block
    took 128 times its size in each fp32 temporary (issue 67)."""
    columns = rows.shape[-1]
    whole = columns // INT8_BLOCK
    views = []
    if whole:
        views.append((rows[..., : whole * INT8_BLOCK].unflatten(-1, (whole, INT8_BLOCK)), scales[..., :whole]))
    if columns % INT8_BLOCK:
        views.append((rows[..., whole * INT8_BLOCK :].unsqueeze(-2), scales[..., whole:]))
    return [(blocks, block_scales.unsqueeze(-1)) for blocks, block_scales in views]


# Rounding by addition (:func:`_quantize_blocks_`): fp32 holds every integer of [2**23, 2**24)
# and nothing between them, so adding 1.5 * 2**23 (an even integer) to a quotient of magnitude
# under 2**22 rounds it to an integer, half to even, exactly as ``round`` does. The sum's fp32
# bits, read as an int32, are then 0x4B400000 + the rounded quotient, whose low byte
# (0x4B400000's is 0) is the quotient's int8 for a quotient in [-127, 127].
_ROUNDING_MAGIC = 1.5 * 2**23
# The dtypes whose every value fp32 holds: their blocks are divided as they are, without an
# fp32 copy.
_WIDENED_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)


def _int8_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """127 and :data:`_ROUNDING_MAGIC` as 0-dim fp32 tensors on ``device``.

    On the device, not Python numbers: CUDA's true division takes a Python number, or any 0-dim
    CPU tensor, as a CPU scalar and multiplies by its reciprocal (``BinaryDivTrueKernel.cu``),
    which moves about 4.5% of the scales one ulp off ``max|x| / 127``; a divisor on the device
    is divided by, as on the CPU. Made by fill kernels: no host-to-device copy, so no sync and
    nothing a CUDA-graph capture refuses; made per call, not cached, so a captured graph fills
    its own (a cached tensor made during a capture would hold its value only after a replay)."""
    return (torch.full((), float(INT8_MAX), dtype=torch.float32, device=device),
            torch.full((), _ROUNDING_MAGIC, dtype=torch.float32, device=device))


def _quantize_blocks_(blocks: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                      constants: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Quantize ``blocks`` (``[..., INT8_BLOCK]``, fp32, bf16 or fp16) into ``values`` (int8, of
    their shape) and ``scales`` (fp32, ``[..., 1]``), in place: the module docstring's formula,
    bit for bit, in four passes over the blocks on a GPU and three small ops on their scales.

    1. ``max|x|`` per block, one read (``vector_norm(ord=inf)``: the exact maximum of ``|x|``,
       +0.0 for zeros, NaN if the block holds one, as ``abs().amax()``, which writes ``|x|``
       first).
    2. ``magic + x / divisor``, one read and one fp32 write (``addcdiv``: the true quotient,
       then the sum that rounds it, :data:`_ROUNDING_MAGIC`; with its ``value`` 1 both the CPU
       kernel, ``self + value * t1 / t2``, and CUDA's, ``pointwise_op_impl``'s ``input +
       op(t1, t2)`` or ``a + alpha * (b / c)`` in older torch, add the fp32 quotient to the
       magic once, in fp32). The divisor is the scale, or 127 where the scale is 0: that block
       holds zeros, or subnormals whose maximum / 127 underflowed (all under 2**-142), and any
       of them / 127 rounds to 0, the formula's 0.
    3. ``clamp_`` to ``magic ± 127``, one read and write. Not a no-op: where the scale is
       subnormal it can be coarse enough for ``max|x| / scale`` to pass 127 (max|x| = 143 *
       2**-149: scale 2**-149, quotient 143). A normal scale is within 2**-24 of max|x| / 127,
       so there every quotient rounds into [-127, 127]; any quotient is under 191 in magnitude,
       far inside the magic's 2**22.
    4. The sums' bits as int32 copied into int8, one read and one int8 write: the conversion
       keeps the low byte (``static_cast``, modulo 2**8 with every compiler torch is built with;
       AVX-512's ``_mm512_cvtepi32_epi8`` truncates alike; a saturating one would store 127
       for every value, which the tests would see).

    (``abs``, ``amax``, a division, ``where``, ``round_``, ``clamp_`` and a cast took seven.) The
    scales' small ops: the fp32 widening of bf16 or fp16 maxima, the division by a device 127
    (:func:`_int8_constants`) written into ``scales``, and the divisor's ``gt`` and ``where``.

    On the CPU the same bits come from the forms its kernels run fast: bf16 and fp16 widened
    first (a mixed-dtype ``addcdiv`` takes about 8 times as long as the widening and an fp32
    one together), the maxima as ``abs().amax()`` (torch's CPU inf-norm does not vectorize
    along a row: about 8 times slower), and step 2 as a division, then the magic's addition
    (the bits of ``addcdiv`` with ``value`` 1; the CPU's ``addcdiv`` takes the 0-dim magic
    through a strided loop, about 6 times slower than the two), measured on 2-core AVX-512
    VMs with torch 2.13."""
    int8_max, magic = constants
    on_cpu = blocks.device.type == "cpu"
    if on_cpu:
        blocks = blocks.float()
        sums = blocks.abs()  # then the quotients, in the same memory (warm in the cache)
        maxima = sums.amax(dim=-1, keepdim=True)
    else:
        maxima = torch.linalg.vector_norm(blocks, ord=math.inf, dim=-1, keepdim=True).float()
    torch.div(maxima, int8_max, out=scales)
    divisor = torch.where(scales > 0, scales, int8_max)
    if on_cpu:
        torch.div(blocks, divisor, out=sums).add_(_ROUNDING_MAGIC)
    else:
        sums = torch.addcdiv(magic, blocks, divisor)
    sums.clamp_(_ROUNDING_MAGIC - INT8_MAX, _ROUNDING_MAGIC + INT8_MAX)
    values.copy_(sums.view(torch.int32))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any float dtype; its rows :func:`_rows`) as int8 values of its shape and fp32
    scales of :func:`scales_shape`, block by block of each row (module docstring;
    :func:`_quantize_blocks_`). New tensors."""
    rows = _rows(x if x.dtype in _WIDENED_EXACTLY else x.to(torch.float32))
    values = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty((*rows.shape[:-1], blocks_per_row(rows.shape[-1])), dtype=torch.float32, device=x.device)
    constants = _int8_constants(x.device)
    for (blocks, _), (value_blocks, block_scales) in zip(_block_views(rows, scales), _block_views(values, scales)):
        _quantize_blocks_(blocks, value_blocks, block_scales, constants)
    return values.view(x.shape), scales.view(scales_shape(x.shape))


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values * scale`` block by block, as a new tensor of ``dtype`` and ``values``' shape
    (computed in fp32, then cast: exact for fp32, one rounding for bf16)."""
    rows = _rows(values)
    out = torch.empty(rows.shape, dtype=torch.float32, device=values.device)
    scales = scales.reshape(*rows.shape[:-1], blocks_per_row(rows.shape[-1]))
    for (value_blocks, block_scales), (out_blocks, _) in zip(_block_views(rows, scales), _block_views(out, scales)):
        torch.mul(value_blocks, block_scales, out=out_blocks)
    return out.view(values.shape).to(dtype)


# The step's reads and writes: momenta held alike on one device (bf16; int8 whose rows are
# whole blocks) are read into one flat buffer, so a list costs a few ops, not a dozen per
# tensor; the others one by one. Either way each element gets the bits of :func:`quantize_int8`
# and :func:`dequantize_int8`: the arithmetic is per element and block.

# Elements a batched store quantizes at once (a multiple of INT8_BLOCK): its fp32 temporaries
# stay a few times this, whatever the momenta's size.
ROUNDING_CHUNK_NUMEL = 1 << 24


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
    return values.is_contiguous() and (scales is None or (row_length(values.shape) % INT8_BLOCK == 0
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
        flat = _joined([values[k] for k in members]).to(torch.float32 if int8 else dtype)
        if int8:
            flat.view(-1, INT8_BLOCK).mul_(_joined([scales[k] for k in members]).unsqueeze(1))
            flat = flat.to(dtype)
        for k, view in zip(members, flat.split(numels)):
            copies.working[k] = view.view(values[k].shape)
        copies.batches.append((members, flat))
    return copies


def _joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` (contiguous) flat and end to end: a view of one alone, else a new tensor."""
    return tensors[0].view(-1) if len(tensors) == 1 else torch.cat([t.view(-1) for t in tensors])


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
        if oks is None and len(members) == 1:  # rounded straight into its store: no new tensor, no copy
            (k,) = members
            if scales[k] is None:
                values[k].view(-1).copy_(flat)
            else:
                _quantize_flat(flat, values[k].view(-1), scales[k].view(-1))
            continue
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


def _quantize_flat(flat: torch.Tensor, values: torch.Tensor | None = None,
                   scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8` of a flat run of whole blocks, chunk by chunk
    (:data:`ROUNDING_CHUNK_NUMEL`): int8 values and fp32 scales, flat (into ``values`` and
    ``scales`` where given), each chunk written in place by :func:`_quantize_blocks_` (four
    passes over it)."""
    if values is None or scales is None:
        values = torch.empty(flat.numel(), dtype=torch.int8, device=flat.device)
        scales = torch.empty(flat.numel() // INT8_BLOCK, dtype=torch.float32, device=flat.device)
    constants = _int8_constants(flat.device)
    for start in range(0, flat.numel(), ROUNDING_CHUNK_NUMEL):
        end = min(start + ROUNDING_CHUNK_NUMEL, flat.numel())
        chunk = flat[start:end] if flat.dtype in _WIDENED_EXACTLY else flat[start:end].to(torch.float32)
        _quantize_blocks_(chunk.view(-1, INT8_BLOCK), values[start:end].view(-1, INT8_BLOCK),
                          scales[start // INT8_BLOCK : end // INT8_BLOCK].view(-1, 1), constants)
    return values, scales
