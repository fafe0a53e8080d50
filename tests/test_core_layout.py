"""The optimizer's core reads as its parts: ``DMuon.step`` is the five phases of
``dmuon.step.phases`` in order, no function in dmuon/ over 60 lines (read with ast); the
cost model's network options; the process-group cache of the fast path."""

from __future__ import annotations

import ast
import math
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmuon import DMuon
from dmuon.options.checks import check_link_gbps
from dmuon.plan.cost_model import CostModel

pytestmark = pytest.mark.unit

DMUON = Path(__file__).resolve().parents[1] / "dmuon"
# What DMuon.step calls on its phases object, in order (docs/architecture.md, "The step").
PHASES = ("prepare", "check_locally", "agree", "wait", "compute_and_apply", "report")
MAX_FUNCTION_LINES = 60


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def phase_calls(source: str) -> list[str]:
    """The methods ``DMuon.step`` calls on ``phases`` and on the ``step`` it prepares, in source order."""
    (dmuon,) = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "DMuon"]
    (step,) = [node for node in dmuon.body if isinstance(node, ast.FunctionDef) and node.name == "step"]
    calls = [node for node in ast.walk(step) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and isinstance(node.func.value, ast.Name) and node.func.value.id in ("phases", "step")]
    return [call.func.attr for call in sorted(calls, key=lambda call: (call.lineno, call.col_offset))]


def test_dmuon_step_reads_as_the_phases_in_order():
    assert phase_calls((DMUON / "optimizer.py").read_text()) == list(PHASES)


def test_a_step_that_skips_or_reorders_a_phase_is_caught():
    source = (DMUON / "optimizer.py").read_text()
    assert phase_calls(source.replace("        step.wait()\n", "")) != list(PHASES)


def test_no_function_in_dmuon_is_over_60_lines():
    sources = sorted(DMUON.rglob("*.py"))
    assert sources
    long = {}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > MAX_FUNCTION_LINES:
                long[f"{path.relative_to(DMUON.parent)}::{node.name}"] = _lines(node)
    assert long == {}


# ------------------------------------------------------------------ link_gbps


def _params() -> list[tuple[str, nn.Parameter]]:
    return [("w", nn.Parameter(torch.randn(4, 4)))]


def test_link_options_default_to_the_cost_models_and_reach_it():
    default = DMuon(_params())
    assert (default.link_gbps, default.replica_link_gbps) == (CostModel.link_gbps, CostModel.replica_link_gbps) == (
        400.0, 400.0)
    chosen = DMuon(_params(), link_gbps=200, replica_link_gbps=25.5)
    assert (chosen.link_gbps, chosen.replica_link_gbps) == (200.0, 25.5)
    cost = chosen.phases.fast_path.cost_model("cpu")
    assert (cost.link_gbps, cost.replica_link_gbps) == (200.0, 25.5)


@pytest.mark.parametrize("name", ["link_gbps", "replica_link_gbps"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "400", None])
def test_a_bad_link_option_is_rejected_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"DMuon: {name} must be a positive finite number"):
        DMuon(_params(), **{name: value})


def test_the_link_validator_names_the_option_and_where_it_was_set():
    assert check_link_gbps(100, "link_gbps", "here") == 100.0
    with pytest.raises(ValueError, match=r"^\[optimizer\]: replica_link_gbps must be .* got 0$"):
        check_link_gbps(0, "replica_link_gbps", "[optimizer]")


def test_copies_keep_the_link_options():
    import copy

    optimizer = DMuon(_params(), link_gbps=100.0, replica_link_gbps=12.5)
    copied = copy.deepcopy(optimizer)
    assert (copied.link_gbps, copied.replica_link_gbps) == (100.0, 12.5)
    assert copied.phases.fast_path.cost_model("cpu").replica_link_gbps == 12.5


# ------------------------------------------------------------------ process groups


def _init_one_rank() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def test_groups_made_for_a_rank_set_do_not_outlive_the_default_group(monkeypatch):
    """A group made for ranks (0,) of a (pretend) 2-rank world is reused while the default
    group lives, and made afresh after ``destroy_process_group()`` and a new init."""
    from dmuon.step import fast_path

    made = []
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kwargs: made.append(tuple(ranks)) or object())
    assert not dist.is_initialized()
    _init_one_rank()
    try:
        first = fast_path.group_of((0,), [])
        assert fast_path.group_of((0,), []) is first and made == [(0,)]
    finally:
        dist.destroy_process_group()
    _init_one_rank()
    try:
        assert fast_path.group_of((0,), []) is not first and made == [(0,), (0,)]
    finally:
        dist.destroy_process_group()
