"""``dmuon.cuda_graphs.CapturedStep`` (issue 42, item 3) on the CPU: what it refuses to
capture, each with the reason, and the host checks that stop a stale graph from replaying.
The capture and replay themselves need a GPU: tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from dmuon import AttentionHeads, DMuon
from dmuon.cuda_graphs import CapturedStep, capture_problems

pytestmark = pytest.mark.unit


def _params() -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    return [("wq", torch.nn.Parameter(torch.randn(8, 8, generator=gen))),
            ("wk", torch.nn.Parameter(torch.randn(8, 8, generator=gen))),
            ("bias", torch.nn.Parameter(torch.randn(8, generator=gen)))]


def test_a_capturable_optimizer_on_the_cpu_is_refused_for_its_parameters_place():
    optimizer = DMuon(_params(), capturable=True)
    assert [p.split(":")[0] for p in capture_problems(optimizer)] == ["parameters not on a CUDA device (FSDP2's "
                                                                      "CPU offload steps on the host)"]
    with pytest.raises(ValueError, match=r"^dmuon.cuda_graphs: this DMuon's step cannot be captured: parameters "
                                         r"not on a CUDA device .*\['wq', 'wk', 'bias'\]"):
        CapturedStep(optimizer)


def test_every_option_that_cannot_be_captured_is_named_with_what_to_do():
    params = _params()
    optimizer = DMuon(params, telemetry=True, qk_clip_threshold=50.0)
    optimizer.clip_attention("attn", params[0][1], params[1][1], AttentionHeads(2, 2, 4))
    problems = capture_problems(optimizer)
    assert [p.split(":")[0] for p in problems] == [
        "capturable=False", "telemetry=True", "QK-clip", "parameters not on a CUDA device (FSDP2's CPU offload "
                                                         "steps on the host)"]
    assert "construct DMuon with capturable=True" in problems[0]


def _unchecked(optimizer: DMuon) -> CapturedStep:
    """A CapturedStep past its constructor's device check (the host checks run on any device)."""
    captured = CapturedStep.__new__(CapturedStep)
    captured.optimizer, captured.warmup_steps, captured.eager_steps, captured.graph = optimizer, 1, 0, None
    captured._captured, captured._status_copies = [], []
    return captured


def _captured_now():
    """A capturable DMuon with every grad, and a CapturedStep that took its fingerprint now."""
    params = _params()
    optimizer = DMuon(params, capturable=True)
    for _, p in params:
        p.grad = torch.zeros_like(p)
    captured = _unchecked(optimizer)
    captured._captured = captured._fingerprint()
    return optimizer, params, captured


def test_a_parameter_without_a_grad_is_refused_before_any_step_naming_it():
    params = _params()
    captured = _unchecked(DMuon(params, capturable=True))
    params[0][1].grad = torch.zeros(8, 8)
    with pytest.raises(ValueError, match=r"no grad for \['wk', 'bias'\].*zero_grad\(set_to_none=False\)"):
        captured.step()


@pytest.mark.parametrize("change, what", [
    (lambda opt, params: setattr(params[0][1], "grad", torch.zeros(8, 8)), "a grad tensor"),
    (lambda opt, params: opt.param_groups[0].__setitem__("lr", torch.tensor(0.1, dtype=torch.float64)),
     "lr or weight_decay's tensor"),
    (lambda opt, params: opt.param_groups[0].__setitem__("momentum", 0.5), "an option"),
])
def test_a_replay_after_a_change_the_graph_cannot_see_is_refused(change, what):
    optimizer, params, captured = _captured_now()
    captured._check_unchanged()  # nothing changed: no error
    change(optimizer, params)
    with pytest.raises(RuntimeError, match=rf"param group 0 changed since the capture \({what}"):
        captured._check_unchanged()


def test_a_scheduled_lr_filled_in_place_is_no_change():
    optimizer, _, captured = _captured_now()
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    optimizer.step()
    scheduler.step()
    captured._check_unchanged()


@pytest.mark.parametrize("warmup", [0, 1.5])
def test_warmup_steps_must_be_a_positive_int(warmup, monkeypatch):
    monkeypatch.setattr("dmuon.cuda_graphs.capture_problems", lambda optimizer: [])
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 1"):
        CapturedStep(DMuon(_params(), capturable=True), warmup_steps=warmup)
