"""DMuon(telemetry=True): the last step's times, bytes and update/weight RMS (dmuon/step/telemetry.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon import DMuon
from tests import telemetry_scenarios
from tests.multiprocess import run_on_ranks

# Marked per test: single-process figures (unit), the same figures on two gloo ranks
# (multirank), and CUDA event timing (cuda).


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 16))  # 2 matrices (Muon), 2 biases (AdamW)


def _step(optimizer: DMuon, model: nn.Module) -> None:
    model(torch.randn(4, 24)).square().mean().backward()
    optimizer.step()


def _rms(tensors: list[torch.Tensor]) -> float:
    flat = torch.cat([t.double().flatten() for t in tensors])
    return flat.square().mean().sqrt().item()


@pytest.mark.unit
def test_telemetry_is_off_by_default_and_reads_none():
    model = _model()
    optimizer = DMuon(model.parameters(), weight_decay=0.1)
    _step(optimizer, model)
    assert optimizer.telemetry() is None


@pytest.mark.unit
def test_telemetry_reads_none_before_the_first_step():
    assert DMuon(_model().parameters(), telemetry=True).telemetry() is None


@pytest.mark.unit
def test_update_and_weight_rms_are_those_of_the_actual_weight_change_per_part():
    model = _model()
    optimizer = DMuon(model.parameters(), lr=0.02, adamw_lr=0.01, weight_decay=0.1, telemetry=True)
    _step(optimizer, model)  # a first step, so AdamW's second one is not its bias-corrected first
    before = [p.detach().clone() for p in model.parameters()]
    _step(optimizer, model)
    after = [p.detach() for p in model.parameters()]
    muon = [i for i, p in enumerate(model.parameters()) if p.ndim == 2]
    adamw = [i for i, p in enumerate(model.parameters()) if p.ndim < 2]
    figures = optimizer.telemetry()
    assert figures.muon_update_rms == pytest.approx(_rms([after[i] - before[i] for i in muon]), rel=1e-6)
    assert figures.muon_weight_rms == pytest.approx(_rms([after[i] for i in muon]), rel=1e-6)
    assert figures.adamw_update_rms == pytest.approx(_rms([after[i] - before[i] for i in adamw]), rel=1e-6)
    assert figures.adamw_weight_rms == pytest.approx(_rms([after[i] for i in adamw]), rel=1e-6)


@pytest.mark.unit
def test_times_are_positive_and_newton_schulz_is_part_of_the_step():
    model = _model()
    optimizer = DMuon(model.parameters(), telemetry=True)
    _step(optimizer, model)
    figures = optimizer.telemetry()
    assert 0 < figures.newton_schulz_s <= figures.step_s
    assert figures.bytes_sent == 0  # one process: nothing travels


@pytest.mark.unit
def test_telemetry_does_not_change_the_parameters():
    results = []
    for telemetry in (False, True):
        model = _model()
        optimizer = DMuon(model.parameters(), weight_decay=0.1, telemetry=telemetry)
        torch.manual_seed(1)
        for _ in range(3):
            _step(optimizer, model)
        results.append([p.detach() for p in model.parameters()])
    without, with_telemetry = results
    assert len(without) == len(with_telemetry) > 0
    assert all(torch.equal(a, b) for a, b in zip(without, with_telemetry))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(telemetry_scenarios.figures_sharded_and_single, 2)


@pytest.mark.multirank
def test_on_two_ranks_rms_figures_cover_the_whole_matrices_like_a_single_process(two_ranks):
    for rank_result in two_ranks:
        sharded, single = rank_result["sharded"], rank_result["single"]
        for key in ("muon_update_rms", "muon_weight_rms", "adamw_update_rms", "adamw_weight_rms"):
            assert sharded[key] == pytest.approx(single[key], rel=1e-6), key


@pytest.mark.multirank
def test_on_two_ranks_bytes_sent_are_the_last_steps_share_of_comm_stats(two_ranks):
    for rank_result in two_ranks:
        per_step = rank_result["sharded"]["bytes_sent"]
        assert per_step > 0
        # Same matrices every step: each step sends the same bytes.
        assert per_step * rank_result["steps"] == rank_result["bytes_total"]


@pytest.mark.unit
def test_combined_figures_of_two_optimizers_add_times_and_bytes_and_pool_the_rms():
    from dmuon.step.telemetry import StepFigures

    a = StepFigures.from_sums(1.0, 0.5, 10, [1.0, 4.0, 1.0, 0.0, 0.0, 0.0])  # Muon only
    b = StepFigures.from_sums(2.0, 0.25, 20, [3.0, 0.0, 3.0, 9.0, 9.0, 1.0])
    combined = StepFigures.combine([a, b])
    assert (combined.step_s, combined.newton_schulz_s, combined.bytes_sent) == (3.0, 0.75, 30)
    assert combined.muon_update_rms == pytest.approx(1.0)  # (1 + 3) / (1 + 3) elements
    assert combined.muon_weight_rms == pytest.approx(1.0)  # 4 / 4
    assert combined.adamw_update_rms == pytest.approx(3.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_times_come_from_events_and_rms_matches_the_cpu_run():
    figures = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = nn.Linear(24, 32).to(device)
        optimizer = DMuon(model.parameters(), telemetry=True)
        model(torch.ones(4, 24, device=device)).square().mean().backward()
        optimizer.step()
        figures[device] = optimizer.telemetry()
    assert 0 < figures["cuda"].newton_schulz_s <= figures["cuda"].step_s
    assert figures["cuda"].muon_update_rms == pytest.approx(figures["cpu"].muon_update_rms, rel=1e-2)


@pytest.mark.unit
def test_a_step_rejected_for_a_bad_grad_leaves_the_last_complete_steps_figures():
    model = _model()
    optimizer = DMuon(model.parameters(), telemetry=True)
    _step(optimizer, model)  # complete, and not read yet
    optimizer.zero_grad()
    model(torch.randn(4, 24)).square().mean().backward()
    model[0].weight.grad = model[0].weight.grad.to_sparse()  # rejected before anything changes
    with pytest.raises(ValueError):
        optimizer.step()
    figures = optimizer.telemetry()
    assert figures.step_s > 0 and figures.muon_update_rms > 0


@pytest.mark.unit
def test_bytes_sent_is_documented_as_the_owner_exchanges_only():
    """``comm="redistribute"`` (the reference path) moves each matrix through DTensor's
    ``full_tensor()``, which ``bytes_sent`` does not count; the docs say so rather than
    "bytes this rank sent" (issue 43, item 9)."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    row = next(line for line in (docs / "torchtitan.md").read_text().splitlines() if line.startswith("| `sent` |"))
    assert "owner exchange" in row and '`comm = "redistribute"`' in row and "not counted" in row, row
    assert 'so `comm="redistribute"` reports 0' in " ".join((docs / "optimizer.md").read_text().split())
