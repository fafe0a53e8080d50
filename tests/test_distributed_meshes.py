"""Every TorchTitan parallelism takes the owner exchange and stays bitwise exact.

Four gloo ranks on a 2 x 2 mesh: HSDP, FSDP over TP, TP under data parallel, expert
stacks under EP and EP + FSDP (tests/mesh_scenarios.py), with Newton-Schulz split
across replicas and without. TorchTitan's own llama3 parallelize (real
``_StridedShard``) is in tests/test_distributed_titan_layouts.py.
"""

from __future__ import annotations

import pytest

from tests import mesh_scenarios as scenarios
from tests.multiprocess import run_on_ranks

CASE_NAMES = [name for group in scenarios.MESH_CASES.values() for name, _, _ in group]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """Per setting of split_replicas, every rank's figures."""
    return {
        "split": run_on_ranks(scenarios.mesh_exactness, 4, True),
        "apart": run_on_ranks(scenarios.mesh_exactness, 4, False),
        "tiny_batches": run_on_ranks(scenarios.mesh_exactness, 4, True, 16),
    }


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("setting", ["split", "apart", "tiny_batches"])
def test_every_layout_is_bitwise_equal_to_single_process(results, setting, case):
    assert all(rank["equal"][case] for rank in results[setting])


def test_no_muon_parameter_of_these_layouts_takes_the_reference_path(results):
    assert set(results["split"][0]["paths"].values()) == {"all_to_all"}


@pytest.mark.parametrize("setting", ["split", "apart"])
def test_comm_stats_count_exactly_the_bytes_and_flops_the_plan_predicts(results, setting):
    for rank in results[setting]:
        assert rank["bytes"] == rank["planned_bytes"]
        assert rank["ns_flops"] == rank["planned_ns_flops"]


def test_splitting_across_replicas_runs_less_newton_schulz_on_the_busiest_rank(results):
    split = max(rank["ns_flops"] for rank in results["split"])
    apart = max(rank["ns_flops"] for rank in results["apart"])
    assert split < apart


def test_pipeline_stages_plan_over_their_own_ranks_only():
    stages = run_on_ranks(scenarios.two_stages_on_their_own_ranks, 4)
    assert all(stage["equal"] for stage in stages)
    assert all(stage["paths"] == {"w": "all_to_all"} for stage in stages)
