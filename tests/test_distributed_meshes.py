"""Every TorchTitan parallelism takes the owner exchange and stays bitwise exact.

Four gloo ranks on a 2 x 2 mesh: HSDP, FSDP over TP, TP under data parallel, expert
stacks under EP and EP + FSDP (tests/mesh_scenarios.py), with Newton-Schulz split
across replicas and without; and again with NorMuon and cautious weight decay on
(their state included). TorchTitan's own llama3 parallelize (real
``_StridedShard``) is in tests/test_distributed_titan_layouts.py.
"""

from __future__ import annotations

import pytest

from tests import mesh_scenarios as scenarios
from tests.distributed_scenarios import NS_DTYPES, per_ns_dtype
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

CASE_NAMES = [name for group in scenarios.MESH_CASES.values() for name, _, _ in group]


@pytest.fixture(scope="module")
def every_dtype() -> dict[str, dict[str, list[dict]]]:
    """Per setting of split_replicas (and batch size), per ns_dtype, every rank's figures."""
    settings = {"split": (True,), "apart": (False,), "tiny_batches": (True, 16)}
    by_rank = {setting: run_on_ranks(per_ns_dtype, 4, scenarios.mesh_exactness, *args)
               for setting, args in settings.items()}
    return {setting: {dtype: [rank[dtype] for rank in ranks] for dtype in NS_DTYPES}
            for setting, ranks in by_rank.items()}


@pytest.fixture(scope="module")
def results(every_dtype) -> dict[str, list[dict]]:
    """The figures with Newton-Schulz in bf16 (what the checks of paths, bytes and flops read)."""
    return {setting: by_dtype["bfloat16"] for setting, by_dtype in every_dtype.items()}


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("setting", ["split", "apart", "tiny_batches"])
@pytest.mark.parametrize("ns_dtype", NS_DTYPES)
def test_every_layout_is_bitwise_equal_to_single_process(every_dtype, ns_dtype, setting, case):
    assert [rank["equal"][case] for rank in every_dtype[setting][ns_dtype]] == [True] * 4


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


@pytest.fixture(scope="module")
def variants() -> dict[str, list[dict[str, dict]]]:
    """Per ns_dtype, every rank's figures with NorMuon and cautious weight decay on."""
    ranks = run_on_ranks(per_ns_dtype, 4, scenarios.mesh_variants_exactness)
    return {dtype: [rank[dtype] for rank in ranks] for dtype in NS_DTYPES}


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("setting", ["split", "apart"])
@pytest.mark.parametrize("ns_dtype", NS_DTYPES)
def test_normuon_and_cautious_weight_decay_on_every_layout_are_bitwise_equal_to_single_process(
        variants, ns_dtype, setting, case):
    assert [rank[setting]["equal"][case] for rank in variants[ns_dtype]] == [True] * 4


@pytest.mark.parametrize("setting", ["split", "apart"])
def test_every_ranks_normuon_state_on_every_layout_equals_the_single_process_state(variants, setting):
    moments = variants["bfloat16"][0][setting]["moments"]
    assert moments == dict.fromkeys(CASE_NAMES, True)


def test_pipeline_stages_plan_over_their_own_ranks_only():
    stages = run_on_ranks(scenarios.two_stages_on_their_own_ranks, 4)
    assert [stage["equal"] for stage in stages] == [True] * 4
    assert [stage["paths"] for stage in stages] == [{"w": "all_to_all"}] * 4


def test_a_pipeline_stages_group_is_made_by_every_rank_together():
    """Under eager NCCL (``init_process_group(device_id=...)``) a group made by its members
    only can hang; a stage's n-D mesh is flattened instead, every rank taking part."""
    stages = run_on_ranks(scenarios.two_stages_on_their_own_ranks, 4)
    assert [stage["local_groups"] for stage in stages] == [0] * 4
