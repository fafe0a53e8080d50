"""Gram Newton-Schulz (dmuon.numerics.gram_newton_schulz) and how DMuon chooses and runs it
(``ns_algorithm``, ``ns_gram_restarts``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gram_accuracy import make_input, polar_factor
from dmuon import DMuon
from dmuon.numerics import gram_newton_schulz as gns
from dmuon.numerics.gram_newton_schulz import gram_dtype, gram_flops, resolve_ns_algorithm, segment_lengths, uses_gram
from dmuon.numerics.newton_schulz import (
    KELLER_COEFFICIENTS,
    newton_schulz_flops,
    orthogonalize,
    orthogonalize_row_blocks,
)

pytestmark = pytest.mark.unit

SCHEDULES = ["keller", "polar_express", KELLER_COEFFICIENTS, [(3.4445, -4.7750, 2.0315), (3.0, -3.2, 1.2)]]
# Accuracy: Gram may land this much (relative Frobenius distance) farther from the polar factor than standard.
ACCURACY_MARGIN = 2e-3


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _distance(ortho: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ortho.double() - exact).norm() / exact.norm()).item()


# ------------------------------------------------------------------ flops


@pytest.mark.parametrize("aspect", [1, 1.5, 2, 3.5, 4, 8])
def test_five_iterations_with_one_restart_cost_8a_plus_28_cubes(aspect):
    m = 64
    assert gram_flops(m, int(aspect * m), 5, (2,)) == (8 * aspect + 28) * m**3


def test_gram_and_standard_cost_the_same_at_aspect_one_and_a_half():
    assert gram_flops(64, 96, 5) == newton_schulz_flops((64, 96), 5) == (20 * 1.5 + 10) * 64**3


def test_restarts_outside_the_iterations_change_nothing():
    assert segment_lengths(5, (0, 2, 5, 9)) == segment_lengths(5, (2,)) == [2, 3]
    assert segment_lengths(5, ()) == [5]


@pytest.mark.parametrize("shape, expected", [((64, 64), False), ((64, 96), False), ((64, 104), True),
                                              ((104, 64), True), ((3, 64, 256), True)])
def test_auto_picks_gram_only_where_it_costs_fewer_flops(shape, expected):
    assert uses_gram("auto", shape, 5) is expected


def test_flops_follow_the_algorithm_auto_taking_the_cheaper():
    square, wide = (64, 64), (64, 256)
    assert newton_schulz_flops(square, 5, "gram") > newton_schulz_flops(square, 5, "auto") == newton_schulz_flops(square)
    assert newton_schulz_flops(wide, 5, "auto") == newton_schulz_flops(wide, 5, "gram") == gram_flops(64, 256, 5)
    assert newton_schulz_flops((4, 64, 256), 5, "gram") == 4 * gram_flops(64, 256, 5)


# ------------------------------------------------------------------ the iteration


@pytest.mark.parametrize("coefficients", SCHEDULES)
@pytest.mark.parametrize("steps, restarts", [(1, (2,)), (5, (2,)), (5, ()), (7, (1, 3))])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_gram_computes_the_standard_polynomial_in_exact_arithmetic(coefficients, steps, restarts, shape):
    update = _randn(*shape).double()
    standard = orthogonalize(update, coefficients, steps, dtype=torch.float64)
    gram = orthogonalize(update, coefficients, steps, dtype=torch.float64, algorithm="gram", restarts=restarts)
    torch.testing.assert_close(gram, standard, atol=1e-2, rtol=0)  # both rounded to bf16 at the end
    assert (gram.double() - standard.double()).abs().gt(0).float().mean() < 0.01


def test_gram_never_modifies_its_input():
    update = _randn(16, 48)
    before = update.clone()
    orthogonalize(update, algorithm="gram")
    assert torch.equal(update, before)


def test_each_expert_of_a_stack_runs_gram_alone_bit_for_bit():
    stack = _randn(3, 16, 48)
    assert torch.equal(orthogonalize(stack, algorithm="gram"),
                       torch.stack([orthogonalize(m, algorithm="gram") for m in stack]))


def test_each_head_runs_gram_alone_bit_for_bit():
    update = _randn(12, 40)
    heads = torch.cat([orthogonalize(block, algorithm="auto", dtype=torch.float32) for block in update.split(4)])
    assert torch.equal(orthogonalize_row_blocks(update, 4, dtype=torch.float32, algorithm="auto"), heads)


def test_fp16_gram_normalizes_before_leaving_fp32_so_large_updates_stay_finite():
    update = _randn(16, 64) * 1e6  # beyond fp16's range of 65504
    ortho = orthogonalize(update, algorithm="gram", gram_dtype_override=torch.float16)
    assert torch.isfinite(ortho).all()


# ------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("kind", ["gaussian", "momentum"])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (48, 384)])
def test_fp32_gram_lands_as_close_to_the_polar_factor_as_fp32_standard(kind, shape):
    update = make_input(kind, shape, torch.Generator().manual_seed(1))
    exact = polar_factor(update)
    standard = _distance(orthogonalize(update, "polar_express", dtype=torch.float32), exact)
    gram = _distance(orthogonalize(update, "polar_express", dtype=torch.float32, algorithm="auto"), exact)
    assert gram <= standard + ACCURACY_MARGIN


@pytest.mark.parametrize("shape", [(64, 256), (256, 64)])
def test_fp16_gram_lands_as_close_to_the_polar_factor_as_bf16_standard(shape):
    """The pairing ``auto`` makes on accelerators."""
    update = make_input("momentum", shape, torch.Generator().manual_seed(2))
    exact = polar_factor(update)
    standard = _distance(orthogonalize(update), exact)
    gram = _distance(orthogonalize(update, algorithm="gram", gram_dtype_override=torch.float16), exact)
    assert gram <= standard + ACCURACY_MARGIN


def test_without_a_restart_fp16_gram_drifts_from_the_polar_factor():
    update = make_input("momentum", (64, 256), torch.Generator().manual_seed(2))
    exact = polar_factor(update)
    restarted = _distance(orthogonalize(update, algorithm="gram", gram_dtype_override=torch.float16), exact)
    drifted = _distance(orthogonalize(update, algorithm="gram", restarts=(), gram_dtype_override=torch.float16), exact)
    assert drifted > restarted + 0.05


# ------------------------------------------------------------------ dtype per device


def test_gram_runs_in_fp32_when_newton_schulz_does():
    assert gram_dtype(torch.float32, "cuda") == gram_dtype(torch.float32, "cpu") == torch.float32


def test_gram_runs_in_fp16_in_place_of_bf16_on_accelerators():
    assert gram_dtype(torch.bfloat16, "cuda") == torch.float16
    assert resolve_ns_algorithm("auto", torch.bfloat16, "cuda") == "auto"


@pytest.mark.parametrize("fp16_gemm, expected", [(True, torch.float16), (False, torch.float32)])
def test_on_a_cpu_gram_runs_in_fp16_only_with_an_fp16_gemm(monkeypatch, fp16_gemm, expected):
    monkeypatch.setattr(gns, "mkldnn_fp16_supported", lambda: fp16_gemm)
    assert gram_dtype(torch.bfloat16, "cpu") == expected


def test_auto_keeps_standard_where_gram_would_multiply_slower(monkeypatch):
    monkeypatch.setattr(gns, "mkldnn_fp16_supported", lambda: False)
    assert resolve_ns_algorithm("auto", torch.bfloat16, "cpu") == "standard"
    assert resolve_ns_algorithm("auto", torch.float32, "cpu") == "auto"
    assert resolve_ns_algorithm("gram", torch.bfloat16, "cpu") == "gram"  # asked for: runs, in fp32


# ------------------------------------------------------------------ the optimizer option


def _params() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(_randn(32, 32).float()), torch.nn.Parameter(_randn(16, 96).float()),
              torch.nn.Parameter(_randn(2, 40, 8).float())]
    for i, p in enumerate(params):
        p.grad = _randn(*p.shape, seed=i + 1).float()
    return params


@pytest.mark.parametrize("algorithm", ["standard", "gram", "auto"])
def test_dmuon_counts_the_flops_of_the_algorithm_it_runs(algorithm):
    params = _params()
    optimizer = DMuon(params, ns_algorithm=algorithm, ns_dtype="float32")
    optimizer.step()
    assert optimizer.comm_stats.ns_flops == sum(newton_schulz_flops(p.shape, 5, algorithm) for p in params)


def test_standard_is_the_default():
    default, standard = _params(), _params()
    optimizer = DMuon(default)
    optimizer.step()
    DMuon(standard, ns_algorithm="standard").step()
    assert optimizer.param_groups[0]["ns_algorithm"] == "standard"
    assert all(torch.equal(a, b) for a, b in zip(default, standard))


@pytest.mark.parametrize("value", ["fast", None, "Gram"])
def test_an_unknown_ns_algorithm_is_refused_by_name(value):
    with pytest.raises(ValueError, match="ns_algorithm must be one of"):
        DMuon(_params(), ns_algorithm=value)


@pytest.mark.parametrize("value", [(0,), (-1,), ("2",), (True,), (2, 2), 2, "2"])
def test_bad_ns_gram_restarts_are_refused_by_name(value):
    with pytest.raises(ValueError, match="ns_gram_restarts must be distinct positive ints"):
        DMuon(_params(), ns_gram_restarts=value)


def test_a_group_may_set_its_own_algorithm_and_restarts():
    params = _params()
    optimizer = DMuon([{"params": params[:1]}, {"params": params[1:], "ns_algorithm": "gram",
                                                "ns_gram_restarts": [3, 1]}])
    assert [g["ns_algorithm"] for g in optimizer.param_groups] == ["standard", "gram"]
    assert optimizer.param_groups[1]["ns_gram_restarts"] == (1, 3)
