"""Momentum stored in bf16 or block-wise int8 (``dmuon.numerics.momentum_storage``, issue 51):
the blocks lie in rows, so a rank's rows quantize to the bits the whole matrix gives them,
and a row split is exact exactly where it falls on a block boundary."""

from __future__ import annotations

import pytest
import torch

from dmuon.numerics import momentum_storage
from dmuon.numerics.momentum_storage import (
    INT8_BLOCK,
    bytes_per_element,
    dequantize_int8,
    parse_momentum_dtype,
    quantize_int8,
    read_momenta,
    scales_shape,
    store_momenta_,
)
from tests.momentum_helpers import row_split_on_blocks

pytestmark = pytest.mark.unit


def _momentum(*shape: int, seed: int = 0) -> torch.Tensor:
    """A momentum-like tensor: mostly small values, a few outliers."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 1e-3
    x.view(-1)[:: 97] *= 50
    return x


@pytest.mark.parametrize("rows", [[3, 5, 0, 2], [10], [0, 10], [4, 4, 2]], ids=str)
def test_a_ranks_rows_quantize_to_the_bits_of_the_whole_matrix(rows):
    whole = _momentum(sum(rows), 300)
    values, scales = quantize_int8(whole)
    start = 0
    for count in rows:  # uneven and empty shards, as FSDP's Shard(0) makes them
        part_values, part_scales = quantize_int8(whole[start : start + count])
        assert torch.equal(part_values, values[start : start + count])
        assert torch.equal(part_scales, scales[start : start + count])
        start += count


def test_each_expert_of_a_stack_quantizes_alone():
    stack = _momentum(4, 6, 256, seed=1)
    values, scales = quantize_int8(stack)
    for e in range(4):
        one_values, one_scales = quantize_int8(stack[e])
        assert torch.equal(one_values, values[e]) and torch.equal(one_scales, scales[e])


@pytest.mark.parametrize("split, exact", [(256, True), (128, True), (200, False)])
def test_a_column_split_is_exact_only_on_a_block_boundary(split, exact):
    whole = _momentum(8, 512, seed=2)
    values, _ = quantize_int8(whole)
    left, _ = quantize_int8(whole[:, :split])
    right, _ = quantize_int8(whole[:, split:])
    assert row_split_on_blocks(split) == exact
    assert torch.equal(torch.cat([left, right], dim=1), values) == exact


def test_dequantized_values_are_within_half_a_step_of_the_input():
    x = _momentum(16, 300, seed=3)
    values, scales = quantize_int8(x)
    back = dequantize_int8(values, scales, torch.float32)
    step = torch.repeat_interleave(scales, INT8_BLOCK, dim=-1)[:, :300]
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-6))
    assert values.dtype == torch.int8 and values.abs().max() == 127
    assert scales.shape == scales_shape(x.shape) == (16, 3)


def test_a_block_of_zeros_has_scale_zero_and_reads_back_zeros():
    x = _momentum(2, 256, seed=4)
    x[0, :INT8_BLOCK] = 0
    values, scales = quantize_int8(x)
    assert scales[0, 0] == 0 and torch.all(values[0, :INT8_BLOCK] == 0)
    assert torch.all(dequantize_int8(values, scales, torch.float32)[0, :INT8_BLOCK] == 0)


def test_quantizing_again_what_was_read_back_keeps_the_values():
    values, scales = quantize_int8(_momentum(8, 384, seed=5))
    again, _ = quantize_int8(dequantize_int8(values, scales, torch.float32))
    assert torch.equal(again, values)


def test_the_negated_momentum_quantizes_to_the_negated_values():
    x = _momentum(4, 130, seed=6)
    values, scales = quantize_int8(x)
    negated, same_scales = quantize_int8(-x)
    assert torch.equal(negated, -values) and torch.equal(same_scales, scales)


@pytest.mark.parametrize("shape", [(64, 32, 3, 3), (64, 64, 1, 1), (8, 3, 5, 7, 2)], ids=str)
def test_a_4d_weight_is_blocked_along_the_rows_of_its_o_by_rest_matrix(shape):
    # Issue 60, item 5: Muon's matrix of an [O, C, kh, kw] kernel is [O, C * kh * kw]; its last
    # dim alone (3, or 1) would cost a scale every few elements.
    x = _momentum(*shape, seed=7)
    values, scales = quantize_int8(x)
    matrix_values, matrix_scales = quantize_int8(x.reshape(shape[0], -1))
    assert values.shape == x.shape and torch.equal(values.reshape(shape[0], -1), matrix_values)
    assert scales.shape == scales_shape(shape) == matrix_scales.shape
    assert torch.equal(scales, matrix_scales)
    assert torch.equal(dequantize_int8(values, scales, torch.float32).reshape(shape[0], -1),
                       dequantize_int8(matrix_values, matrix_scales, torch.float32))
    for start, stop in ((0, 5), (5, 5), (5, shape[0])):  # FSDP's rows of it, an empty shard among them
        part_values, part_scales = quantize_int8(x[start:stop])
        assert torch.equal(part_values, values[start:stop]) and torch.equal(part_scales, scales[start:stop])


@pytest.mark.parametrize("momentum_dtype, shape, most", [
    ("int8", (4096, 4096), 1.05), ("int8", (14336, 4096), 1.05), ("int8", (8, 256, 4096), 1.05),
    ("int8", (64, 32, 3, 3), 1.05), ("int8", (256, 128, 1, 1), 1.05), ("bfloat16", (4096, 4096), 2.0),
])
def test_the_state_bytes_per_element_stay_within_the_issues_bounds(momentum_dtype, shape, most):
    assert bytes_per_element(shape, momentum_dtype, torch.float32) <= most
    assert bytes_per_element(shape, None, torch.float32) == 4.0


@pytest.mark.parametrize("given, read", [(None, None), (torch.bfloat16, "bfloat16"), ("bfloat16", "bfloat16"),
                                         ("int8", "int8")])
def test_a_momentum_dtype_is_read_from_its_names(given, read):
    assert parse_momentum_dtype(given) == read


@pytest.mark.parametrize("given", ["fp8", torch.float16, "float32", 8])
def test_another_momentum_dtype_is_refused_naming_the_allowed_ones(given):
    with pytest.raises(ValueError, match="None .*bfloat16.*'int8'"):
        parse_momentum_dtype(given)


def test_a_momentum_held_in_the_parameters_dtype_is_read_as_itself():
    buf = _momentum(4, 6)
    assert read_momenta([buf], [None], [torch.float32]).working[0] is buf


@pytest.mark.parametrize("held", ["bfloat16", "int8"])
def test_a_masked_store_keeps_the_values_and_scales_bit_for_bit(held):
    old = _momentum(4, 300)
    values, scales = quantize_int8(old) if held == "int8" else (old.bfloat16(), None)
    before = (values.clone(), None if scales is None else scales.clone())
    copies = read_momenta([values], [scales], [torch.float32])
    copies.working[0].mul_(3)  # what a step would store, were it not masked
    store_momenta_([values], [scales], copies, [torch.tensor(False)])
    assert torch.equal(values, before[0]) and (scales is None or torch.equal(scales, before[1]))
    store_momenta_([values], [scales], copies, [torch.tensor(True)])
    working = copies.working[0]
    expected = quantize_int8(working) if held == "int8" else (working.bfloat16(), None)
    assert torch.equal(values, expected[0]) and (scales is None or torch.equal(scales, expected[1]))


SHAPES = [(4, 256), (2, 3, 128), (4, 300), (1, 128), (5, 6)]  # whole blocks (read together) and not


@pytest.mark.parametrize("chunk", [1 << 22, 2 * INT8_BLOCK], ids=["one_chunk", "many_chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_momenta_read_and_stored_together_have_each_ones_own_bits(dtype, chunk, monkeypatch):
    monkeypatch.setattr(momentum_storage, "ROUNDING_CHUNK_NUMEL", chunk)
    kept = [quantize_int8(_momentum(*shape, seed=i)) for i, shape in enumerate(SHAPES)]
    values, scales = [v for v, _ in kept], [s for _, s in kept]
    copies = read_momenta(values, scales, [dtype] * len(SHAPES))
    assert copies.batches and copies.alone  # both ways ran
    for work, v, s in zip(copies.working, values, scales):
        assert torch.equal(work, dequantize_int8(v, s, dtype))
    for i, work in enumerate(copies.working):
        work.mul_(0.9).add_(_momentum(*SHAPES[i], seed=10 + i).to(dtype), alpha=0.1)  # the EMA, in place
    expected = [quantize_int8(work) for work in copies.working]
    store_momenta_(values, scales, copies)
    for (v, s), (want_v, want_s) in zip(zip(values, scales), expected):
        assert torch.equal(v, want_v) and torch.equal(s, want_s)


# ------------------------------------------------------- the int8 arithmetic, bit for bit (issue 59)


def _plain_formula(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's formula in plain fp32 ops, for a 2-D ``x``: per block of 128 columns
    of a row, ``scale = amax / 127`` (a true division: the CPU divides by a Python number) and
    ``q = round(x / scale)`` (half to even) clamped to [-127, 127], 0 where the scale is 0."""
    columns = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, -columns % INT8_BLOCK))
    blocks = padded.unflatten(-1, (-1, INT8_BLOCK))
    scales = blocks.abs().amax(dim=-1, keepdim=True) / 127
    values = torch.where(scales > 0, blocks / scales, 0.0).round().clamp(-127, 127).to(torch.int8)
    return values.flatten(-2)[..., :columns], scales.squeeze(-1)


def _awkward_momentum(dtype: torch.dtype) -> torch.Tensor:
    """Seeded rows over 70 decades (a short last block: 300 columns), with rows of zeros (+0 and
    -0), of subnormals whose scale underflows to 0 (max 1e-44) or is itself subnormal (max 2e-43;
    max 143 * 2**-149, where the quotient passes 127 before the clamp), of halfway quotients,
    of large magnitudes, and of bf16's subnormals."""
    generator = torch.Generator().manual_seed(59)
    x = torch.randn(40, 300, generator=generator) * torch.logspace(-30, 30, 40).unsqueeze(1)
    x[0], x[1] = 0.0, -0.0
    for row, top in ((2, 1e-44), (3, 2e-43), (4, 143 * 2.0**-149)):
        x[row] = torch.rand(300, generator=generator) * top
        x[row, ::INT8_BLOCK] = top
    x[5] = torch.arange(300) % 64 + 0.5  # scale 1: quotients k + 0.5, rounded to the even k
    x[5, ::INT8_BLOCK] = 127.0
    x[6] = torch.randn(300, generator=generator) * 1e37
    x[7] = torch.randn(300, generator=generator) * 1e-40  # subnormal in bf16 too
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_values_and_scales_have_the_plain_formulas_bits(dtype):
    x = _awkward_momentum(dtype)
    values, scales = quantize_int8(x)
    want_values, want_scales = _plain_formula(x)
    assert torch.equal(values, want_values)
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))  # -0.0 is not 0.0 here
    if dtype == torch.float32:  # the cases were hit (bf16 holds none of these subnormals: its least is 2**-133)
        assert scales[2].eq(0).all() and values[2].eq(0).all() and values[4, 0] == 127


def test_int8_scales_are_the_true_quotient_where_a_reciprocal_product_is_an_ulp_off():
    # CUDA divides a tensor by a Python number as x * (1 / 127), one ulp off the quotient for
    # some x: here they are found, and every scale must be the quotient, correctly rounded.
    generator = torch.Generator().manual_seed(1)
    candidates = torch.rand(4096, generator=generator) * 10.0 ** torch.randint(-30, 30, (4096,), generator=generator)
    product = candidates * (torch.tensor(1.0) / 127)
    amax = candidates[(candidates / 127).view(torch.int32) != product.view(torch.int32)][:64]
    assert amax.numel() == 64
    x = torch.rand(64, INT8_BLOCK, generator=generator) * amax.unsqueeze(1)
    x[:, 7] = -amax
    _, scales = quantize_int8(x)
    assert torch.equal(scales.squeeze(1), (amax.double() / 127).float())


def test_a_block_whose_scale_underflows_to_zero_reads_back_zeros():
    x = torch.zeros(3, 256)
    x[0, :INT8_BLOCK] = torch.linspace(0, 1e-44, INT8_BLOCK)  # max / 127 is under fp32's least subnormal
    x[1, INT8_BLOCK:] = -1e-44
    values, scales = quantize_int8(x)
    assert torch.equal(scales, torch.zeros(3, 2)) and torch.equal(values, torch.zeros(3, 256, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batched_store_quantizes_as_quantize_int8(dtype, monkeypatch):
    monkeypatch.setattr(momentum_storage, "ROUNDING_CHUNK_NUMEL", 3 * INT8_BLOCK)  # chunks of three blocks
    x = _awkward_momentum(dtype)[:, :256]
    values, scales = momentum_storage._quantize_flat(x.reshape(-1))
    want_values, want_scales = quantize_int8(x)
    assert torch.equal(values, want_values.view(-1)) and torch.equal(scales, want_scales.view(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_block_maxima_a_gpu_reads_in_one_pass_are_the_cpus(dtype):
    # Off the CPU the store takes max|x| as vector_norm(ord=inf), one read; on the CPU as
    # abs().amax(), faster there: the two must be the same bits (+0.0 for -0.0 rows, subnormals).
    blocks = _awkward_momentum(dtype)[:, :256].unflatten(-1, (-1, INT8_BLOCK))
    one_pass = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1)
    assert torch.equal(one_pass.float().view(torch.int32), blocks.abs().amax(dim=-1).float().view(torch.int32))


def test_fp64_momentum_quantizes_as_its_fp32_rounding_does():
    # The documented limit (docs/optimizer.md, "Limits of int8"): int8 runs in fp32 for every
    # parameter dtype, so an fp64 block has the bits of its fp32 rounding.
    x = _momentum(4, 300, seed=8).double() * (1 + 1e-12)
    values, scales = quantize_int8(x)
    fp32_values, fp32_scales = quantize_int8(x.float())
    assert torch.equal(values, fp32_values) and torch.equal(scales, fp32_scales)
    assert dequantize_int8(values, scales, torch.float64).dtype == torch.float64
