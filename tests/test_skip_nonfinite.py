"""``skip_nonfinite=True`` (issue 42, item 4): a step where any grad holds a NaN or inf
changes nothing (parameters, every state value, step counts), decided on the device, and
the steps after it equal a run that never had it. Multi-rank cases (a NaN on one rank
only, every layout of the fault sweep) are in tests/test_fault_sweep.py."""

from __future__ import annotations

import pytest
import torch

from dmuon import DMuon

pytestmark = pytest.mark.unit

BAD_STEP = 2


def _params() -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    return [("w", torch.nn.Parameter(torch.randn(8, 6, generator=gen))),
            ("bias", torch.nn.Parameter(torch.randn(6, generator=gen)))]


def _grads(params, step: int, poison: float | None = None) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    if poison is not None:
        params[1][1].grad[3] = poison


def _bits(optimizer: DMuon, params) -> list[bytes]:
    found = [p.detach().numpy().tobytes() for _, p in params]
    sd = optimizer.state_dict()  # as a checkpoint reads it
    for state in sd["state"].values():
        found += [v.numpy().tobytes() for _, v in sorted(state.items())]
    return found


def _run(steps: list[int], poison: float | None = None, **options):
    params = _params()
    optimizer = DMuon(params, lr=0.02, weight_decay=0.1, skip_nonfinite=True, **options)
    for step in steps:
        _grads(params, step, poison if step == BAD_STEP else None)
        optimizer.step()
    return optimizer, params


# capturable: its masked decay is a device factor (exactly 1 where masked), not the host's skip.
@pytest.mark.parametrize("capturable", [False, True], ids=["float", "capturable"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_grad_step_changes_no_parameter_state_or_step_count(poison, capturable):
    optimizer, params = _run([0, 1], capturable=capturable)
    before = _bits(optimizer, params)
    _grads(params, BAD_STEP, poison)
    optimizer.step()
    assert _bits(optimizer, params) == before


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
def test_the_steps_after_a_skipped_step_equal_a_run_that_never_had_it(fused):
    skipped, params = _run([0, 1, BAD_STEP, 3, 4], float("nan"), fused=fused)
    never, reference = _run([0, 1, 3, 4], fused=fused)
    assert _bits(skipped, params) == _bits(never, reference)
    assert skipped.skipped_steps == 1 and never.skipped_steps == 0


def test_skipped_steps_are_counted_by_the_next_step_or_state_dict():
    optimizer, params = _run([0, 1, BAD_STEP], float("nan"))
    assert optimizer.skipped_steps == 0  # the device's answer is read one step late...
    optimizer.state_dict()
    assert optimizer.skipped_steps == 1  # ...or when a checkpoint reads the state


def test_off_by_default_a_nan_grad_is_applied_as_torch_muon_applies_it():
    params = _params()
    optimizer = DMuon(params, lr=0.02)
    _grads(params, 0, float("nan"))
    optimizer.step()
    assert params[1][1].isnan().any() and optimizer.skipped_steps == 0


def test_skip_nonfinite_must_be_true_or_false():
    with pytest.raises(ValueError, match=r"DMuon: skip_nonfinite must be a bool \(True or False\), got 1"):
        DMuon(_params(), skip_nonfinite=1)


def test_an_error_in_the_adamw_part_leaves_the_muon_part_as_it_was(monkeypatch):
    import dmuon.step.adamw_part

    optimizer, params = _run([0, 1])
    before = params[0][1].detach().clone()

    def raising(*args, **kwargs):
        raise RuntimeError("AdamW failed")

    monkeypatch.setattr(dmuon.step.adamw_part, "_group_step", raising)
    _grads(params, BAD_STEP)
    with pytest.raises(RuntimeError, match="AdamW failed"):
        optimizer.step()
    assert torch.equal(params[0][1], before)  # the device-made mask turned False for the Muon part too


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
def test_a_skipped_step_with_capturable_leaves_the_adamw_part_undecayed(fused):
    """Issue 49's seam: with ``capturable=True`` the AdamW decay runs on the device before
    torch's fused kernel, whose ``found_inf`` skips only its own update."""
    optimizer, params = _run([0, 1], capturable=True, fused=fused)
    before = _bits(optimizer, params)
    _grads(params, BAD_STEP, float("nan"))
    optimizer.step()
    assert _bits(optimizer, params) == before


def test_skip_nonfinite_set_after_construction_is_read_at_the_next_step():
    # The step reads the optimizer's options as they are at each step (dmuon.step.phases.StepOptions).
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = DMuon([weight], lr=0.02)
    optimizer.skip_nonfinite = True
    before = weight.detach().clone()
    weight.grad = torch.full_like(weight, float("nan"))
    optimizer.step()
    optimizer.state_dict()  # reads the step's status: the skip is counted
    assert torch.equal(weight.detach(), before) and optimizer.skipped_steps == 1


def test_a_huge_finite_grad_is_no_skip():
    # 1e20 is finite in fp32, its square is not: whether a grad is finite is decided on its
    # largest magnitude, never on a sum of squares.
    params = _params()
    optimizer = DMuon(params, lr=0.02, weight_decay=0.1, skip_nonfinite=True)
    _grads(params, 0)
    params[1][1].grad[3] = 1e20
    optimizer.step()
    optimizer.state_dict()
    assert optimizer.skipped_steps == 0
