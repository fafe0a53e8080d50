"""scripts/leading_steps.py on synthetic loss curves."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "leading_steps.py"
_spec = importlib.util.spec_from_file_location("leading_steps", _PATH)
leading = importlib.util.module_from_spec(_spec)
sys.modules["leading_steps"] = leading
_spec.loader.exec_module(leading)


def curve(steps: range, loss_at) -> dict[int, float]:
    return {s: loss_at(s) for s in steps}


def decaying(s: float) -> float:
    return 2.0 + 5.0 / (1.0 + 0.05 * s)  # strictly decreasing, like a training loss


def test_a_candidate_shifted_k_steps_ahead_leads_by_k_once_past_the_first_k_steps():
    baseline = curve(range(1, 201), decaying)
    ahead = curve(range(1, 201), lambda s: decaying(s + 30))
    result = leading.leading_steps(baseline, ahead)
    assert all(result[s] == 30 for s in range(31, 201))
    # Before step 31 the candidate's first step (1, loss of step 31) is already lower.
    assert all(result[s] == s - 1 for s in range(1, 31))


def test_identical_curves_lead_by_zero():
    baseline = curve(range(1, 101), decaying)
    assert set(leading.leading_steps(baseline, dict(baseline)).values()) == {0}


def test_a_slower_candidate_trails_with_negative_leading_steps():
    baseline = curve(range(1, 201), lambda s: decaying(s + 20))
    behind = curve(range(1, 201), decaying)
    result = leading.leading_steps(baseline, behind)
    assert all(result[s] == -20 for s in range(1, 181))


def test_baseline_losses_the_candidate_never_reaches_give_none():
    baseline = curve(range(1, 101), decaying)
    stalls = curve(range(1, 101), lambda s: max(decaying(s), decaying(50)))
    result = leading.leading_steps(baseline, stalls)
    assert result[50] == 0 and result[51] is None and result[100] is None


def test_smoothing_recovers_the_shift_through_per_step_noise():
    noise = {s: (0.3 if s % 2 else -0.3) for s in range(1, 301)}  # zero mean over any 2 steps
    baseline = curve(range(1, 301), lambda s: decaying(s) + noise[s])
    ahead = curve(range(1, 301), lambda s: decaying(s + 25) + noise[s])
    raw = leading.leading_steps(baseline, ahead)
    smoothed = leading.leading_steps(baseline, ahead, window=20)
    assert any(raw[s] != 25 for s in range(100, 301))  # noise dips reach targets early
    # The trailing mean lags by about window/2 steps on both curves; the shift survives
    # up to a step of rounding where the curve flattens.
    assert all(abs(smoothed[s] - 25) <= 1 for s in range(60, 301))


def test_moving_average_is_trailing_and_starts_with_fewer_values():
    assert leading.moving_average({1: 3.0, 2: 1.0, 3: 5.0, 4: 0.0}, 2) == {1: 3.0, 2: 2.0, 3: 3.0, 4: 2.5}


def test_steps_to_reach_returns_the_first_sample_and_the_interpolated_crossing():
    val = {1: 8.0, 20: 6.0, 40: 5.0, 60: 4.0}
    assert leading.steps_to_reach(val, 4.5) == (60, pytest.approx(50.0))
    assert leading.steps_to_reach(val, 6.0) == (20, pytest.approx(20.0))
    assert leading.steps_to_reach(val, 9.0) == (1, 1.0)


def test_steps_to_reach_a_loss_never_reached_is_none():
    assert leading.steps_to_reach({1: 8.0, 20: 6.0}, 5.0) == (None, None)


def test_on_sampled_curves_a_candidate_shifted_k_steps_ahead_leads_by_k():
    baseline = curve(range(20, 201, 20), lambda s: 10.0 - 0.02 * s)  # validation every 20 steps
    ahead = curve(range(20, 201, 20), lambda s: 10.0 - 0.02 * (s + 30))
    result = leading.leading_steps_on_samples(baseline, ahead)
    # Reached between samples: interpolation recovers the 30 steps, not a multiple of 20.
    assert all(result[s] == pytest.approx(30.0) for s in range(60, 201, 20))
    assert leading.leading_steps_on_samples(ahead, baseline)[200] is None  # the slower run never gets there
