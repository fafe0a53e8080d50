"""No step is half-applied: whatever refuses or breaks a step leaves every Muon parameter
and its state as they were (issue 32, item 3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon import DMuon
from dmuon.step import adamw_part

pytestmark = pytest.mark.unit


def model_and_optimizer() -> tuple[nn.Sequential, DMuon]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    optimizer = DMuon(model.named_parameters(), lr=0.02, weight_decay=0.1)
    model(torch.randn(4, 12)).square().mean().backward()
    optimizer.step()  # state exists
    model(torch.randn(4, 12)).square().mean().backward()
    return model, optimizer


def snapshot(model: nn.Module, optimizer: DMuon) -> dict:
    muon = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
    return {id(p): (p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()}) for p in muon}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k][0], b[k][0]) and all(torch.equal(a[k][1][s], b[k][1][s]) for s in a[k][1]) for k in a)


def test_a_failure_in_the_adamw_part_moves_no_muon_parameter(monkeypatch):
    model, optimizer = model_and_optimizer()
    before = snapshot(model, optimizer)

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("injected AdamW failure")

    monkeypatch.setattr(adamw_part, "_group_step", broken)
    with pytest.raises(RuntimeError, match="injected AdamW failure"):
        optimizer.step()
    assert same(snapshot(model, optimizer), before)


def test_after_a_failed_step_the_next_step_runs():
    model, optimizer = model_and_optimizer()
    optimizer.step()
    assert all(p.isfinite().all() for p in model.parameters())
