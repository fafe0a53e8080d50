"""The elementwise Muon rules (dmuon.numerics.update_rules)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.muon_reference import apply_muon_update_, muon_momentum_
from dmuon.numerics.update_rules import ADJUST_LR_CHOICES, shape_scale

pytestmark = pytest.mark.unit

TALL, WIDE, EXPERTS_TALL, CONV = (64, 16), (16, 64), (8, 36, 4), (32, 2, 3, 3)


@pytest.mark.parametrize(
    "adjust_lr, shape, expected",
    [
        ("original", TALL, 2.0),  # sqrt(max(1, 64/16))
        ("original", WIDE, 1.0),
        ("original", EXPERTS_TALL, 3.0),  # one expert is 36 x 4
        ("original", CONV, math.sqrt(32 / 18)),  # seen as 32 x 18
        ("match_rms_adamw", TALL, 0.2 * 8.0),  # 0.2 * sqrt(max(64, 16))
        ("match_rms_adamw", WIDE, 0.2 * 8.0),
        ("match_rms_adamw", EXPERTS_TALL, 0.2 * 6.0),
        ("spectral", TALL, 2.0),  # sqrt(64/16)
        ("spectral", WIDE, 0.5),
        ("spectral", EXPERTS_TALL, 3.0),
        (None, TALL, 1.0),
        (None, WIDE, 1.0),
        (None, EXPERTS_TALL, 1.0),
    ],
)
def test_shape_scale(adjust_lr, shape, expected):
    assert shape_scale(shape, adjust_lr, 0.2) == pytest.approx(expected, rel=1e-15)


def test_shape_scale_match_rms_adamw_uses_the_given_rms():
    assert shape_scale(TALL, "match_rms_adamw", 0.3) == pytest.approx(0.3 * 8.0, rel=1e-15)


def test_every_advertised_adjust_lr_choice_gives_its_documented_scale():
    # TALL is 64 x 16; matched_adamw_rms is 0.2. A choice added to ADJUST_LR_CHOICES
    # without an entry here fails the key check, so every advertised choice is covered.
    documented = {"original": 2.0, "match_rms_adamw": 0.2 * 8.0, "spectral": 2.0, None: 1.0}
    assert set(ADJUST_LR_CHOICES) == documented.keys()
    for choice, expected in documented.items():
        assert shape_scale(TALL, choice, 0.2) == pytest.approx(expected, rel=1e-15), choice


def test_unknown_adjust_lr_raises_naming_it():
    with pytest.raises(ValueError, match="unknown adjust_lr 'rms'"):
        shape_scale(TALL, "rms", 0.2)


def _grad_and_buffer(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(6, 10, generator=generator).to(dtype)
    buf = torch.randn(6, 10, generator=generator).to(dtype)
    return grad, buf


def test_muon_momentum_with_nesterov_matches_hand_formula():
    grad, buf = _grad_and_buffer()
    mu = 0.9
    expected_buf = buf + (1 - mu) * (grad - buf)
    expected_update = grad + mu * (expected_buf - grad)

    update = muon_momentum_(grad, buf, mu, nesterov=True)

    torch.testing.assert_close(buf, expected_buf)
    torch.testing.assert_close(update, expected_update.bfloat16())


def test_muon_momentum_without_nesterov_returns_the_buffer_values():
    grad, buf = _grad_and_buffer()
    mu = 0.9
    expected_buf = buf + (1 - mu) * (grad - buf)

    update = muon_momentum_(grad, buf, mu, nesterov=False)

    torch.testing.assert_close(buf, expected_buf)
    assert torch.equal(update, buf.bfloat16())


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_momentum_returns_bf16_and_leaves_grad_unchanged(nesterov):
    grad, buf = _grad_and_buffer()
    grad_before = grad.clone()
    update = muon_momentum_(grad, buf, 0.95, nesterov)
    assert update.dtype == torch.bfloat16
    assert torch.equal(grad, grad_before)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_momentum_result_never_aliases_a_bf16_buffer(nesterov):
    grad, buf = _grad_and_buffer(torch.bfloat16)
    update = muon_momentum_(grad, buf, 0.95, nesterov)
    buf_after_momentum = buf.clone()

    update.mul_(0)  # what an in-place normalization would do to an alias

    assert update.data_ptr() != buf.data_ptr()
    assert torch.equal(buf, buf_after_momentum)


def test_apply_muon_update_decays_with_unscaled_lr_then_adds_scaled_step():
    param = torch.full((2, 3), 2.0)
    ortho = torch.ones(2, 3, dtype=torch.bfloat16)
    apply_muon_update_(param, ortho, lr=0.1, weight_decay=0.5, scale=3.0)
    # 2 * (1 - 0.1 * 0.5) - 0.1 * 3 * 1
    torch.testing.assert_close(param, torch.full((2, 3), 1.6))
