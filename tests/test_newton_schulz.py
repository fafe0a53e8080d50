"""Newton-Schulz orthogonalization (dmuon.numerics.newton_schulz): the pure math core."""

from __future__ import annotations

import pytest
import torch

from dmuon.numerics.newton_schulz import KELLER_COEFFICIENTS, matrix_shape, newton_schulz_flops, orthogonalize

pytestmark = pytest.mark.unit


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


# ------------------------------------------------------------------ orthogonalize


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (24, 24), (3, 8, 20), (3, 20, 8)])
def test_orthogonalize_returns_bf16_with_input_shape(shape):
    result = orthogonalize(_randn(*shape))
    assert result.dtype == torch.bfloat16
    assert result.shape == torch.Size(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (3, 20, 8)])
def test_orthogonalize_never_modifies_its_input(shape, dtype):
    """A bf16 input is the torch.optim.Muon aliasing defect: ``x.bfloat16()`` is ``x``."""
    update = _randn(*shape, dtype=dtype)
    before = update.clone()
    result = orthogonalize(update)
    assert torch.equal(update, before)
    assert result.data_ptr() != update.data_ptr()


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (128, 16)])
def test_singular_values_of_result_lie_near_one(shape):
    singular_values = torch.linalg.svdvals(orthogonalize(_randn(*shape)).float())
    assert singular_values.min() > 0.5
    assert singular_values.max() < 1.5


def test_tall_input_is_orthogonalized_as_the_transpose_of_its_wide_form():
    tall = _randn(48, 16)
    assert torch.equal(orthogonalize(tall), orthogonalize(tall.T.contiguous()).T)


@pytest.mark.parametrize("shape", [(4, 12, 20), (4, 20, 12)])
def test_each_expert_of_a_3d_stack_is_orthogonalized_alone_bit_for_bit(shape):
    """What lets the owner plan send experts of one stack to different ranks."""
    stack = _randn(*shape)
    one_by_one = torch.stack([orthogonalize(matrix) for matrix in stack])
    assert torch.equal(orthogonalize(stack), one_by_one)


@pytest.mark.parametrize("shape", [(8, 12), (12, 8), (2, 8, 12)])
def test_zero_matrix_gives_zeros_without_nan(shape):
    result = orthogonalize(torch.zeros(*shape))
    assert torch.equal(result, torch.zeros(*shape, dtype=torch.bfloat16))


def test_result_does_not_depend_on_input_scale():
    """The Frobenius normalization makes NS scale-invariant (up to bf16 rounding)."""
    update = _randn(16, 32)
    torch.testing.assert_close(
        orthogonalize(update).float(), orthogonalize(update * 1000).float(), atol=2e-2, rtol=2e-2
    )


def test_2d_result_is_bitwise_torch_optim_muon_newton_schulz():
    from torch.optim._muon import _zeropower_via_newtonschulz

    for shape in [(16, 48), (48, 16)]:
        update = _randn(*shape)
        expected = _zeropower_via_newtonschulz(update, KELLER_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(orthogonalize(update), expected)


def test_1d_or_4d_input_to_orthogonalize_raises():
    with pytest.raises(ValueError, match="2-D or 3-D"):
        orthogonalize(torch.zeros(8))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        orthogonalize(torch.zeros(2, 2, 3, 3))


# ------------------------------------------------------------------ flops


@pytest.mark.parametrize(
    "shape, steps, expected",
    [
        ((2, 3), 1, 4 * 2 * 2 * 3 + 2 * 2**3),  # m=2, n=3: 48 + 16
        ((3, 2), 1, 4 * 2 * 2 * 3 + 2 * 2**3),  # tall: same as its transpose
        ((64, 256), 5, 5 * (4 * 64 * 64 * 256 + 2 * 64**3)),
        ((4, 8, 16), 5, 4 * 5 * (4 * 8 * 8 * 16 + 2 * 8**3)),  # a batch of 4 experts
        ((16, 4, 3, 3), 2, 2 * (4 * 16 * 16 * 36 + 2 * 16**3)),  # conv: [16, 4*3*3]
    ],
)
def test_newton_schulz_flops_formula(shape, steps, expected):
    assert newton_schulz_flops(shape, steps) == expected


def test_newton_schulz_flops_default_is_five_steps():
    assert newton_schulz_flops((8, 16)) == newton_schulz_flops((8, 16), 5) == 5 * newton_schulz_flops((8, 16), 1)


# ------------------------------------------------------------------ matrix_shape


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((5, 7), (5, 7)),
        ((3, 5, 7), (3, 5, 7)),
        ((16, 4, 3, 3), (16, 36)),
        ((2, 3, 4, 5, 6), (2, 360)),
    ],
)
def test_matrix_shape(shape, expected):
    assert matrix_shape(shape) == expected
    assert matrix_shape(torch.Size(shape)) == expected


@pytest.mark.parametrize("shape", [(7,), ()])
def test_matrix_shape_rejects_fewer_than_two_dims(shape):
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        matrix_shape(shape)


# ------------------------------------------------------------------ coefficient schedules


@pytest.mark.parametrize("shape", [(256, 1024), (1024, 256)])
def test_polar_express_lands_every_singular_value_closer_to_one_than_keller(shape):
    update = _randn(*shape, seed=3)

    def worst_error(coefficients) -> float:
        singular_values = torch.linalg.svdvals(orthogonalize(update, coefficients, steps=5).float())
        return float((singular_values - 1).abs().max())

    assert worst_error("polar_express") < worst_error("keller")


def test_polar_express_is_the_paper_schedule_with_its_bf16_safety_factor():
    from dmuon.numerics.newton_schulz import POLAR_EXPRESS_COEFFICIENTS, coefficient_schedule

    schedule, safety = coefficient_schedule("polar_express", 10)
    assert safety == 1.01
    a, b, c = schedule[0]
    assert (a, b, c) == pytest.approx((8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3,
                                       17.300387312530933 / 1.01**5))
    assert schedule[7:] == [(1.875, -1.25, 0.375)] * 3  # the converged tail, unscaled, repeats
    assert schedule[:8] == list(POLAR_EXPRESS_COEFFICIENTS)


def test_a_per_iteration_list_repeats_its_last_triple():
    from dmuon.numerics.newton_schulz import coefficient_schedule

    schedule, safety = coefficient_schedule([(3.0, -3.0, 1.0), (2.0, -1.5, 0.5)], 4)
    assert schedule == [(3.0, -3.0, 1.0), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5)]
    assert safety == 1.0


def test_a_list_of_one_triple_is_the_triple():
    update = _randn(24, 40)
    assert torch.equal(orthogonalize(update, [KELLER_COEFFICIENTS]), orthogonalize(update, KELLER_COEFFICIENTS))
    assert torch.equal(orthogonalize(update, "keller"), orthogonalize(update, KELLER_COEFFICIENTS))


def test_a_schedule_changes_the_result_only_through_its_iterations():
    update = _randn(24, 40)
    first_only = orthogonalize(update, [(3.0, -3.0, 1.0), (2.0, -1.5, 0.5)], steps=1)
    assert torch.equal(first_only, orthogonalize(update, (3.0, -3.0, 1.0), steps=1))


def test_a_matrix_at_an_odd_offset_of_a_buffer_is_copied_aligned_on_an_accelerator():
    """The owner's matrices are views of one buffer; CUDA reductions depend on the start's
    alignment, so such a view is copied before its norm (``meta`` stands for the device)."""
    from dmuon.numerics.alignment import aligned

    buffer = torch.empty(1000, dtype=torch.bfloat16, device="meta")
    odd = buffer[3 : 3 + 12 * 20].view(12, 20)
    even = buffer[8 : 8 + 12 * 20].view(12, 20)  # 16 bytes in
    assert aligned(odd) is not odd and aligned(odd).storage_offset() == 0
    assert aligned(even) is even


def test_the_cpu_normalizes_a_view_at_any_offset_in_place_of_a_copy():
    """The CPU's reductions do not depend on the start's address: no copy, same bits."""
    from dmuon.numerics import newton_schulz as ns
    from dmuon.numerics.alignment import aligned

    buffer = torch.randn(1000, dtype=torch.bfloat16)
    odd = buffer[3 : 3 + 12 * 20].view(12, 20)
    assert aligned(odd) is odd
    assert torch.equal(ns.orthogonalize(odd), ns.orthogonalize(odd.clone()))
