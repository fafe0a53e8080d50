"""A DMuon pickled before dmuon's modules moved into layer folders still loads and steps
bit for bit as it would have: a pickle names classes by module path, and a checkpoint's
state_dict is kept beside it. The pickle and the script that made it are in tests/data/."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from dmuon import DMuon
from dmuon.numerics.newton_schulz import resolve_ns_dtype

pytestmark = pytest.mark.unit

PICKLE = Path(__file__).resolve().parent / "data" / "dmuon_before_layers.pkl"
# The recorded step ran ns_dtype="auto" on a CPU with native bf16: it chose bf16 Newton-Schulz.
RECORDED_ON_THIS_CPU_CLASS = pytest.mark.skipif(
    resolve_ns_dtype("auto", "cpu") != torch.bfloat16,
    reason="the recorded step ran bf16 Newton-Schulz (ns_dtype='auto' on a bf16 CPU); here 'auto' picks fp32")


@pytest.fixture
def saved(one_thread):
    with open(PICKLE, "rb") as f:
        return pickle.load(f)


def test_a_dmuon_pickled_before_the_move_loads_as_a_dmuon(saved):
    assert type(saved["optimizer"]) is DMuon
    assert len(saved["optimizer"].state) == 3


@RECORDED_ON_THIS_CPU_CLASS
def test_a_dmuon_pickled_before_the_move_takes_the_next_step_it_took_then(saved):
    optimizer, params = saved["optimizer"], saved["params"]
    for param, grad in zip(params, saved["grads"]):
        param.grad = grad.clone()
    optimizer.step()
    for param, expected in zip(params, saved["after_third_step"]):
        assert torch.equal(param.detach(), expected)


@RECORDED_ON_THIS_CPU_CLASS
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
