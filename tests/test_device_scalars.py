"""Scalars a step hands to device ops, and the dry run's recorder that catches the ways
they go wrong on CUDA without a GPU (meta tensors stand in for CUDA ones here, so these
run on the CPU build too; the dry runs at the end need a CUDA build):

- a tensor copied from a Python number or pageable CPU memory to the device makes the
  host wait: the recorder counts it as a host sync;
- a 0-dim device scalar wider than a bf16/fp16 tensor it multiplies is read in the
  tensor's dtype by CUDA: the recorder reports it as a precision hazard;
- a concatenation that casts runs one copy per input on CUDA: the recorder counts each.

DMuon's list decay keeps its factor on the host (an fp32 CPU scalar, which CUDA's
foreach kernel reads at full precision) and cautious decay fills its scalars on the device.
"""

from __future__ import annotations

import random

import pytest
import torch

from dmuon.tools.dry_run.recorder import StepRecorder
from dmuon.numerics.device_scalars import StepScalars
from dmuon.numerics.update_rules import apply_muon_, decay_factor
from dmuon.numerics.update_rules import cautious_decay_
from tests.dry_runs import dry_run, needs_cuda_build, sweep

pytestmark = pytest.mark.unit

LR, WD = 0.02, 0.1


def recorded(fn) -> StepRecorder:
    with StepRecorder() as recorder:
        fn()
    return recorder


# ---------------------------------------------------------------- the recorder's detections


def test_a_scalar_made_on_the_host_and_moved_to_the_device_is_a_host_sync():
    # What torch.as_tensor(0.998, device="cuda") dispatches (the dry run sees it so on fake CUDA).
    record = recorded(lambda: torch.tensor(0.998).to("meta")).record
    assert len(record.host_syncs) == 1 and "pageable" in record.host_syncs[0]


def test_a_scalar_filled_on_the_device_is_no_host_sync():
    assert recorded(lambda: torch.full((), 0.998, device="meta")).record.host_syncs == []


def test_a_copy_of_a_pageable_cpu_tensor_into_device_memory_is_a_host_sync():
    target, source = torch.empty(8, device="meta"), torch.ones(8)
    assert len(recorded(lambda: target.copy_(source)).record.host_syncs) == 1


def test_a_wider_device_scalar_on_a_bf16_list_is_a_precision_hazard():
    params = [torch.empty(4, 4, dtype=torch.bfloat16, device="meta") for _ in range(3)]
    factor = torch.full((), 0.998, dtype=torch.float32, device="meta")
    hazards = recorded(lambda: torch._foreach_mul_(params, factor)).record.precision_hazards
    assert len(hazards) == 1 and "float32 device scalar as bfloat16" in hazards[0]


@pytest.mark.parametrize("factor", [torch.tensor(0.998), torch.full((), 0.998, dtype=torch.bfloat16, device="meta")],
                         ids=["cpu fp32 scalar", "device scalar of the list's dtype"])
def test_a_cpu_scalar_or_one_of_the_lists_dtype_is_no_precision_hazard(factor):
    params = [torch.empty(4, 4, dtype=torch.bfloat16, device="meta") for _ in range(3)]
    assert recorded(lambda: torch._foreach_mul_(params, factor)).record.precision_hazards == []


def test_a_wider_device_scalar_on_an_fp32_list_is_no_precision_hazard():
    params = [torch.empty(4, 4, device="meta") for _ in range(3)]
    factor = torch.full((), 0.998, dtype=torch.float64, device="meta")
    assert recorded(lambda: torch._foreach_mul_(params, factor)).record.precision_hazards == []


@pytest.mark.parametrize("inputs, out, launches", [
    (torch.float32, torch.bfloat16, 3),  # cast while flattening: one copy_ per input
    (torch.bfloat16, torch.bfloat16, 1),
    (torch.float32, torch.float32, 1),
    (torch.bfloat16, torch.float32, 1),  # the one cast CUDA's _chunk_cat does in its kernel
])
def test_a_concatenation_counts_one_launch_or_one_per_input_where_it_casts(inputs, out, launches):
    blocks = [torch.empty(2, 4, dtype=inputs, device="meta") for _ in range(3)]
    send = torch.empty(24, dtype=out, device="meta")
    ops = recorded(lambda: torch._chunk_cat(blocks, 0, 1, out=send.view(1, -1))).record.device_ops
    assert sum(ops.values()) == launches


@pytest.mark.parametrize("scalar_dtype, device, launches", [
    (torch.float32, "meta", 1), (torch.float64, "meta", 3), (torch.int32, "meta", 3),
    (torch.float64, "cpu", 1),  # a CPU scalar is read as a number: the multi-tensor path
])
def test_a_list_op_by_a_scalar_tensor_is_one_launch_only_in_the_lists_dtype(scalar_dtype, device, launches):
    # CUDA's multi-tensor kernel takes a 0-dim device scalar of the list's own dtype; any other
    # falls back to one kernel per tensor.
    params = [torch.empty(n, 4, device="meta") for n in (2, 3, 5)]
    scalar = torch.ones((), dtype=scalar_dtype, device=device)
    ops = recorded(lambda: torch._foreach_mul_(params, scalar)).record.device_ops
    assert sum(ops.values()) == launches


@pytest.mark.parametrize("others, launches", [
    (lambda ps: [p.clone() for p in ps], 1),
    (lambda ps: [p.clone().t().contiguous().t() for p in ps], 1),  # dense, the same strides as the params
    (lambda ps: [p.clone().contiguous() for p in ps], 3),  # dense, other strides: one kernel per pair
    (lambda ps: [torch.empty((), device="meta").expand(p.shape) for p in ps], 3),  # expanded: not dense
])
def test_a_list_op_is_one_launch_where_torch_takes_its_multi_tensor_route(others, launches):
    # torch's rule (ForeachUtils.h): one device and dtype, every operand non-overlapping and
    # dense, the operands at one position of the same sizes and strides.
    params = [torch.empty(4, n, device="meta").t() for n in (2, 3, 5)]  # dense, not contiguous
    operands = others(params)
    ops = recorded(lambda: torch._foreach_add_(params, operands)).record.device_ops
    assert ops["aten._foreach_add_.List"] == launches


@pytest.mark.parametrize("alpha_dtype, launches", [(torch.float32, 1), (torch.float64, 3)])
def test_an_addcmul_by_a_list_of_0_dim_tensors_of_the_lists_dtype_is_one_launch(alpha_dtype, launches):
    # ForeachPointwiseOp.cu's PointwiseOpScalar0dTensorFunctor (issue 59, item 3): the capturable
    # Muon apply's form; another dtype's 0-dim operands fall back to one kernel per tensor.
    params = [torch.empty(n, 4, device="meta") for n in (2, 3, 5)]
    updates = [torch.empty_like(t) for t in params]
    alpha = torch.empty((), dtype=alpha_dtype, device="meta")
    ops = recorded(lambda: torch._foreach_addcmul_(params, [alpha] * 3, updates)).record.device_ops
    assert sum(ops.values()) == launches


def test_a_list_copy_across_dtypes_is_one_launch():
    # foreach_tensor_copy_list_kernel_cuda_ casts in its one kernel (issue 59, item 3).
    targets = [torch.empty(n, 4, dtype=torch.bfloat16, device="meta") for n in (2, 3, 5)]
    sources = [torch.empty(n, 4, device="meta") for n in (2, 3, 5)]
    assert sum(recorded(lambda: torch._foreach_copy_(targets, sources)).record.device_ops.values()) == 1


def test_a_size_1_dims_stride_does_not_take_a_list_op_off_the_route():
    # ForeachUtils.h compares strides of dims longer than 1 only (issue 59, item 3).
    params = [torch.empty(1, n, device="meta") for n in (2, 3, 5)]
    others = [torch.empty(n, 1, device="meta").t() for n in (2, 3, 5)]  # stride (1, 1) against (n, 1)
    assert [p.stride()[0] for p in params] != [o.stride()[0] for o in others]
    assert recorded(lambda: torch._foreach_add_(params, others)).record.device_ops["aten._foreach_add_.List"] == 1


@pytest.mark.parametrize("divide, flagged", [
    (lambda x: x / 127, True), (lambda x: x.div_(127.0), True), (lambda x: x / torch.tensor(127.0), True),
    (lambda x: x / torch.full((), 127.0, device="meta"), False),
    (lambda x: torch.div(x, 127, rounding_mode="floor"), False),
], ids=["number", "in place", "cpu 0-dim", "device 0-dim", "floor"])
def test_a_device_division_by_a_host_number_is_a_precision_hazard(divide, flagged):
    # CUDA computes it as a * (1 / b) (BinaryDivTrueKernel.cu), an ulp off the CPU's quotient
    # for some values (issue 59, item 1).
    x = torch.empty(4, 128, device="meta")
    hazards = recorded(lambda: divide(x)).record.precision_hazards
    assert bool(hazards) == flagged and all("host number" in h for h in hazards)


def test_a_masked_select_over_shared_masks_is_three_launches_per_mask_and_width():
    # A step's two masks (its own, and False for parameters without a grad) over tensors of two
    # widths: three list ops for each (mask, width) pair, whatever the number of tensors.
    from dmuon.numerics.masked_updates import select_

    targets = [torch.empty(n, 4, dtype=dtype, device="meta") for n, dtype in
               ((2, torch.float32), (3, torch.float32), (5, torch.bfloat16), (7, torch.float32))]
    news = [torch.empty_like(t) for t in targets]
    step_ok, never = (torch.empty((), dtype=torch.bool, device="meta") for _ in range(2))
    oks = [step_ok, step_ok, step_ok, never]
    ops = recorded(lambda: select_(targets, oks, news, foreach=True)).record.device_ops
    list_ops = sum(n for name, n in ops.items() if "_foreach_" in name)
    assert list_ops == 3 * 3  # (step_ok, fp32), (step_ok, bf16), (never, fp32)


# ---------------------------------------------------------------- DMuon's scalars


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_list_decay_factor_is_an_fp32_cpu_scalar_whatever_the_lists_device(dtype):
    factor, as_is = decay_factor(1 - LR * WD, dtype, StepScalars())
    assert as_is
    assert factor.device.type == "cpu" and factor.dtype == torch.float32 and factor.ndim == 0
    assert factor.item() == torch.tensor(1 - LR * WD, dtype=torch.float32).item()


def test_the_list_decay_of_fp64_parameters_keeps_an_fp64_factor():
    assert decay_factor(0.998, torch.float64, StepScalars())[0].dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_list_decay_of_reduced_precision_parameters_has_the_per_tensor_bits(dtype):
    torch.manual_seed(0)
    params = [torch.randn(5, 7).to(dtype) for _ in range(3)]
    orthos = [torch.randn(5, 7).to(dtype) for _ in range(3)]
    lists, loop = [p.clone() for p in params], [p.clone() for p in params]
    apply_muon_(lists, orthos, lr=LR, weight_decay=WD, scale=0.5, foreach=True)
    for param, ortho in zip(loop, orthos):  # torch.optim.Muon's per-tensor ops, with numbers
        param.mul_(1 - LR * WD)
        param.add_(ortho, alpha=-LR * 0.5)
    assert all(torch.equal(a, b) for a, b in zip(lists, loop))
    assert not all(torch.equal(a, p) for a, p in zip(lists, params))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_list_decay_on_the_device_has_no_host_sync_and_no_precision_hazard(dtype):
    params = [torch.empty(4, 4, dtype=dtype, device="meta") for _ in range(3)]
    orthos = [torch.empty(4, 4, dtype=dtype, device="meta") for _ in range(3)]
    record = recorded(lambda: apply_muon_(params, orthos, lr=LR, weight_decay=WD, scale=0.5, foreach=True)).record
    assert record.host_syncs == [] and record.precision_hazards == []


def _cautious_factor(param: torch.Tensor) -> torch.Tensor:
    """``1 - LR * WD`` as cautious decay reads it: on the parameter's device (``decay_factor``)."""
    return decay_factor(1 - LR * WD, param.dtype, StepScalars(), device=param.device)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cautious_decay_fills_its_factor_on_the_device_with_no_host_sync_or_precision_hazard(dtype):
    # (On meta, torch.as_tensor(x, device=...) dispatches nothing; on fake CUDA it is a
    # copy from the host, which the dry runs of tests/test_dry_run.py count.)
    param, update = torch.empty(4, 4, dtype=dtype, device="meta"), torch.empty(4, 4, dtype=dtype, device="meta")
    record = recorded(lambda: cautious_decay_(param, update, _cautious_factor(param))).record
    assert record.device_ops["aten.full.default"] == 1
    assert record.host_syncs == [] and record.precision_hazards == []


def test_cautious_decay_keeps_the_plain_decays_bits_where_every_sign_agrees():
    """Seeded, and wide enough that the case which tells the two factors apart occurs: the
    plain decay multiplies bf16 by ``1 - lr * wd`` in fp32, so a factor rounded to bf16
    first (0.998 -> 0.99609375) would move many values one ulp further; and some values
    do move (in bf16 most are left as they were by a 0.2% decay)."""
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(64, 64, generator=generator).bfloat16()
    update = (param.float().sign() * torch.rand(64, 64, generator=generator)).bfloat16()  # every sign agrees
    cautious, plain = param.clone(), param.clone()
    cautious_decay_(cautious, update, _cautious_factor(cautious))
    plain.mul_(1 - LR * WD)
    bf16_factor = param * torch.tensor(1 - LR * WD, dtype=torch.bfloat16)
    assert (plain != param).sum() >= 10 and (plain != bf16_factor).sum() >= 10
    assert torch.equal(cautious, plain)


# ---------------------------------------------------------------- the dry run


@needs_cuda_build
@pytest.mark.parametrize("dtype", [sweep("bfloat16", first_of_rule=True), sweep("float16")])
def test_a_dry_run_with_reduced_precision_parameters_finds_no_precision_hazard(dtype):
    for report in dry_run("--model", "debug", "--world-size", "4", "--ranks", "0,3", "--param-dtype", dtype,
                          "--cautious-weight-decay"):
        assert report.problems() == [], (report.rank, report.problems())
        assert report.precision_hazards == [] and report.host_syncs_per_step == 0


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 16), (16, 48)], ids=["tall", "wide"])
def test_newton_schulz_returns_a_contiguous_result_for_the_scatter_to_flatten(shape, ns_dtype):
    """A transposed result would be copied again inside CUDA's ``_chunk_cat``, one more
    temporary per matrix, all alive at once (unseen by the dry run's fake kernels)."""
    from dmuon.numerics.newton_schulz import orthogonalize

    result = orthogonalize(torch.randn(shape).bfloat16(), dtype=ns_dtype)
    assert result.is_contiguous() and result.dtype == torch.bfloat16 and result.shape == shape


def test_the_device_products_of_lr_and_weight_decay_are_the_numbers_the_host_computes():
    # Over many pairs: a product made in fp32 and widened (or any other rounding) shows.
    draw = random.Random(0)
    for _ in range(500):
        lr, weight_decay, scale = draw.uniform(1e-5, 0.1), draw.uniform(0.0, 0.5), draw.uniform(0.1, 4.0)
        lr_t, wd_t = (torch.tensor(v, dtype=torch.float64) for v in (lr, weight_decay))
        scalars = StepScalars()
        assert scalars.keep(lr_t, wd_t).item() == 1 - lr * weight_decay, (lr, weight_decay)
        assert scalars.alpha(lr_t, scale).item() == -lr * scale, (lr, scale)


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16])
def test_the_muon_apply_on_fp32_weights_calls_no_list_op_off_the_route(update_dtype, capturable):
    # Results kept whole on their owner stay bf16 and meet fp32 weights (an expert under EP):
    # torch's route wants one dtype, so they go per tensor, the kernels its fallback would run.
    params = [torch.empty(n, 4, device="meta") for n in (2, 3, 5)]
    orthos = [torch.empty(n, 4, dtype=update_dtype, device="meta") for n in (2, 3, 5)]
    lr, wd = (torch.full((), v, dtype=torch.float64, device="meta") if capturable else v for v in (LR, WD))
    record = recorded(lambda: apply_muon_(params, orthos, lr=lr, weight_decay=wd, scale=1.0, foreach=True,
                                          capturable=capturable)).record
    assert not record.per_tensor_list_ops, record.per_tensor_list_ops
