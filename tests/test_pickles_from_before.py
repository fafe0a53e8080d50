"""A DMuon pickled before dmuon's modules moved into layer folders still loads and steps
bit for bit as it would have: a pickle names classes by module path, and a checkpoint's
state_dict is kept beside it. The pickle and the script that made it are in tests/data/."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from dmuon import DMuon

pytestmark = pytest.mark.unit

PICKLE = Path(__file__).resolve().parent / "data" / "dmuon_before_layers.pkl"


@pytest.fixture
def saved(one_thread):
    with open(PICKLE, "rb") as f:
        return pickle.load(f)


def test_a_dmuon_pickled_before_the_move_loads_as_a_dmuon(saved):
    assert type(saved["optimizer"]) is DMuon
    assert len(saved["optimizer"].state) == 3


def test_a_dmuon_pickled_before_the_move_takes_the_next_step_it_took_then(saved):
    optimizer, params = saved["optimizer"], saved["params"]
    for param, grad in zip(params, saved["grads"]):
        param.grad = grad.clone()
    optimizer.step()
    for param, expected in zip(params, saved["after_third_step"]):
        assert torch.equal(param.detach(), expected)


def test_a_state_dict_saved_before_the_move_loads_into_a_new_dmuon(saved):
    params = [torch.nn.Parameter(p.detach().clone()) for p in saved["params"]]
    names = ["layers.0.weight", "embed.weight", "norm.weight"]
    optimizer = DMuon(list(zip(names, params)), lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    optimizer.load_state_dict(saved["state_dict"])
    for param, grad in zip(params, saved["grads"]):
        param.grad = grad.clone()
    optimizer.step()
    for param, expected in zip(params, saved["after_third_step"]):
        assert torch.equal(param.detach(), expected)
