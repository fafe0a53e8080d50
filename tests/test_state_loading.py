"""``DMuon.load_state_dict`` keeps Muon's state in the dtype it was saved in, and the plan
follows the groups' Newton-Schulz settings after a load or a direct edit (issue 40, item 9)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon import DMuon

pytestmark = pytest.mark.unit


def _bf16_normuon_run(steps: int) -> tuple[nn.Linear, DMuon]:
    torch.manual_seed(0)
    layer = nn.Linear(16, 24, bias=False).bfloat16()
    optimizer = DMuon([{"params": [("w", layer.weight)], "use_muon": True}], lr=0.02, normuon=True)
    for seed in range(steps):
        layer.weight.grad = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
        optimizer.step()
    return layer, optimizer


def test_a_loaded_normuon_second_moment_stays_fp32_beside_bf16_weights():
    layer, optimizer = _bf16_normuon_run(2)
    saved = optimizer.state_dict()
    assert saved["state"][0]["normuon_second_moment"].dtype == torch.float32
    fresh = DMuon([{"params": [("w", layer.weight)], "use_muon": True}], lr=0.02, normuon=True)
    fresh.load_state_dict(saved)
    moment = fresh.state[layer.weight]["normuon_second_moment"]
    assert moment.dtype == torch.float32
    assert torch.equal(moment, saved["state"][0]["normuon_second_moment"])


def test_a_bf16_normuon_resume_is_bitwise_the_uninterrupted_run():
    layer, optimizer = _bf16_normuon_run(2)
    saved, weights = optimizer.state_dict(), layer.weight.detach().clone()
    resumed = DMuon([{"params": [("w", layer.weight)], "use_muon": True}], lr=0.02, normuon=True)
    resumed.load_state_dict(saved)
    reference, _ = _bf16_normuon_run(4)
    layer.weight.data.copy_(weights)
    for seed in (2, 3):
        layer.weight.grad = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
        resumed.step()
    assert torch.equal(layer.weight, reference.weight)


def test_loading_a_state_dict_forgets_the_plan(monkeypatch):
    _, optimizer = _bf16_normuon_run(1)
    forgotten = []
    monkeypatch.setattr(optimizer.phases, "forget_plan", lambda: forgotten.append(True))
    optimizer.load_state_dict(optimizer.state_dict())
    assert forgotten


@pytest.mark.parametrize("key, value", [("split_rows", 8), ("ns_steps", 3), ("ns_algorithm", "gram")])
def test_editing_a_groups_newton_schulz_setting_remakes_the_plan_at_the_next_step(monkeypatch, key, value):
    layer, optimizer = _bf16_normuon_run(1)
    forgotten = []
    original = optimizer.phases.forget_plan
    monkeypatch.setattr(optimizer.phases, "forget_plan", lambda: (forgotten.append(True), original()))
    layer.weight.grad = torch.ones_like(layer.weight)
    optimizer.step()
    assert not forgotten  # nothing changed: the plan stands
    optimizer.param_groups[0][key] = value
    optimizer.step()
    assert forgotten
