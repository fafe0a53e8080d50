"""Regressions for the ways issue 40 broke the bad-input guarantee, on 2 and 4 gloo ranks:
each case once desynced, hung, leaked a NaN or half-applied a step (see each test's
name); now every rank runs the same collectives, raises the same error by the next step,
and a step that raises changes nothing. Every launch has a timeout (a hang fails)."""

from __future__ import annotations

import pytest

from tests import bad_input_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

LOCAL_ERROR = "ValueError: DMuon: 1 rank(s) found an invalid gradient or shard"
DISAGREE_ERROR = "RuntimeError: DMuon: ranks disagree on which parameters have gradients"


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def faults(request) -> tuple[int, list[dict]]:
    return request.param, run_on_ranks(scenarios.every_fault, request.param, timeout=240)


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def faults_with_telemetry(request) -> list[dict]:
    return run_on_ranks(scenarios.every_fault_with_telemetry, request.param, timeout=240)


def _case(ranks: list[dict], name: str) -> list[dict]:
    return [rank[name] for rank in ranks]


def _raise_together_and_change_nothing(cases: list[dict], next_error: str) -> None:
    assert all(case["k+1"] is not None and case["k+1"].startswith(next_error) for case in cases), cases
    assert len({case["k+1"] for case in cases}) == 1
    assert all(case["unchanged"] for case in cases)
    assert all(case["after"] == [None, None] for case in cases)


def test_a_local_problem_beside_partial_adamw_grads_runs_the_same_collectives(faults):
    world, ranks = faults
    cases = _case(ranks, "local_problem_here_partial_elsewhere")
    assert cases[0]["k"] == ("ValueError: DMuon: parameter 'emb': gradient dtype torch.float64 differs from the "
                             "parameter's torch.float32")
    assert all("parameter 'norm': gradient placements (Partial(sum),)" in case["k"] for case in cases[1:])
    _raise_together_and_change_nothing(cases, f"ValueError: DMuon: {world} rank(s) found an invalid gradient")


def test_a_grad_placed_partial_on_one_rank_and_none_on_others_desyncs_nothing(faults):
    _, ranks = faults
    cases = _case(ranks, "partial_here_none_elsewhere")
    assert "gradient placements (Partial(sum),)" in cases[0]["k"]
    assert [case["k"] for case in cases[1:]] == [None] * (len(cases) - 1)
    _raise_together_and_change_nothing(cases, LOCAL_ERROR)


def test_a_replicated_parameters_grad_partial_on_some_ranks_only_raises_on_every_rank(faults):
    _, ranks = faults
    cases = _case(ranks, "partial_here_replicated_elsewhere")
    assert [case["k"] for case in cases] == [None] * len(cases)
    _raise_together_and_change_nothing(cases, "RuntimeError: DMuon: ranks disagree on how gradients are placed: "
                                              "['rep'] was a Partial sum on some ranks")


@pytest.mark.parametrize("world", [2, 4])
def test_a_replicated_parameters_partial_grad_steps_bitwise_like_dtensors_own_sum(world):
    for rank in run_on_ranks(scenarios.partial_grads_summed_like_dtensor, world, timeout=120):
        assert rank["partial"] == rank["dtensor_sum"]


def test_a_grad_on_another_mesh_raises_there_and_hangs_no_rank(faults):
    _, ranks = faults
    cases = _case(ranks, "grad_on_another_mesh")
    assert cases[-1]["k"] == ("ValueError: DMuon: parameter 'w2': its gradient lives on another device mesh than "
                              "the parameter")
    assert [case["k"] for case in cases[:-1]] == [None] * (len(cases) - 1)
    _raise_together_and_change_nothing(cases, LOCAL_ERROR)


def test_with_telemetry_on_the_steps_after_an_error_stay_in_step(faults_with_telemetry):
    cases = _case(faults_with_telemetry, "complex_grad_on_last_rank")
    _raise_together_and_change_nothing(cases, LOCAL_ERROR)
    assert all(case["telemetry"] for case in cases)


def test_an_adamw_grad_missing_on_some_ranks_is_applied_on_no_rank(faults):
    _, ranks = faults
    cases = _case(ranks, "adamw_grad_missing_on_rank_0")
    assert [case["k"] for case in cases] == [None] * len(cases)
    _raise_together_and_change_nothing(cases, DISAGREE_ERROR)
    assert "['emb']" in cases[0]["k+1"]


def test_a_grad_with_another_local_shape_is_refused_before_any_collective(faults):
    _, ranks = faults
    cases = _case(ranks, "local_shape_differs")
    assert cases[0]["k"].startswith("ValueError: DMuon: parameter 'w1': gradient local shape")
    _raise_together_and_change_nothing(cases, LOCAL_ERROR)


def test_an_adamw_grad_of_another_dtype_half_applies_no_adamw_part(faults):
    _, ranks = faults
    cases = _case(ranks, "adamw_dtype_differs")
    assert cases[0]["k"] == ("ValueError: DMuon: parameter 'norm': gradient dtype torch.float64 differs from the "
                             "parameter's torch.float32")
    _raise_together_and_change_nothing(cases, LOCAL_ERROR)


def test_one_ranks_problem_masks_every_mesh_of_the_optimizer_on_every_rank():
    ranks = run_on_ranks(scenarios.two_meshes_one_problem, 4, timeout=120)
    assert ranks[-1]["k"] == "ValueError: DMuon: parameter 'a': complex gradients are not supported by Muon"
    assert [rank["k"] for rank in ranks[:-1]] == [None, None, None]
    assert not any(rank["params_moved_at_k"] for rank in ranks)
    assert all(rank["k+1"].startswith(LOCAL_ERROR) for rank in ranks)
    assert all(rank["unchanged"] for rank in ranks)
    assert len({tuple(rank["state_keys"]) for rank in ranks}) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_a_nan_grad_in_a_masked_step_leaks_into_no_parameter_momentum_or_normuon_row(world):
    ranks = run_on_ranks(scenarios.nan_in_a_masked_step, world, timeout=120)
    for rank in ranks:
        assert rank["same_at_k"] == {"w1": True, "w1 momentum": True, "w1 normuon": True}
        assert rank["k+1"].startswith(LOCAL_ERROR)
        assert rank["unchanged"]


def test_foreach_false_runs_every_update_rule_per_tensor():
    counts = run_on_ranks(scenarios.foreach_false_runs_no_list_rule, 2, timeout=120)
    assert counts == [{}, {}]
