"""The whole-step owner plan on real gloo ranks: still bit for bit equal to a single
process, whatever the batches, the rank count or the block layout; and the scratch a
real step allocates is what the plan predicts. P = 1 (the local path) is
``tests/test_one_rank.py``."""

from __future__ import annotations

import json

import pytest

from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

ALL = [name for name, _, _ in scenarios.LAYOUT_CASES]
DEFAULT_CAP = 1 << 27


@pytest.fixture(scope="module")
def every_layout() -> dict[int, dict[str, dict]]:
    """Per world size, per ns_dtype: the layout scenario's figures (rank 0)."""
    return {world: run_on_ranks(scenarios.per_ns_dtype, world, scenarios.layout_exactness, ALL, DEFAULT_CAP)[0]
            for world in (2, 4)}


@pytest.mark.parametrize("case", ALL)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_every_block_layout_is_bitwise_equal_to_single_process(every_layout, ns_dtype, world, case):
    assert every_layout[world][ns_dtype]["equal"][case]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_every_block_layout_takes_the_fast_path(every_layout, ns_dtype, world):
    assert set(every_layout[world][ns_dtype]["paths"]) == set(ALL)
    assert set(every_layout[world][ns_dtype]["paths"].values()) == {"all_to_all"}


@pytest.mark.parametrize("ns_algorithm", ["standard", "gram"])
@pytest.mark.parametrize("world", [2, 4])
def test_heads_orthogonalized_apart_are_bitwise_equal_to_single_process_even_split_across_ranks(world, ns_algorithm):
    heads = [name for name, _, _ in scenarios.HEAD_CASES]
    result = run_on_ranks(scenarios.layout_exactness, world, heads, DEFAULT_CAP, 4, "auto", ns_algorithm)[0]
    assert result["equal"] == dict.fromkeys(heads, True)
    assert set(result["paths"].values()) == {"all_to_all"}
    assert len([i for batch in result["batches"] for i in batch]) == 5 + 3  # one unit per head


@pytest.mark.parametrize("world", [2, 4])
def test_every_block_layout_with_gram_newton_schulz_is_bitwise_equal_to_single_process(world):
    result = run_on_ranks(scenarios.layout_exactness, world, ALL, DEFAULT_CAP, None, "float32", "gram")[0]
    assert result["equal"] == dict.fromkeys(ALL, True)
    assert set(result["paths"].values()) == {"all_to_all"}


def test_tiny_batches_leave_some_rank_idle_and_stay_bitwise():
    result = run_on_ranks(scenarios.layout_exactness, 4, ALL, 64)[0]
    assert len(result["batches"]) > 1
    assert result["idle_in_some_batch"]
    assert result["equal"] == dict.fromkeys(ALL, True)


def test_more_ranks_than_matrices_stays_bitwise():
    result = run_on_ranks(scenarios.layout_exactness, 4, ["rows", "tall"], DEFAULT_CAP)[0]
    assert result["equal"] == {"rows": True, "tall": True}


def test_experts_split_across_ranks_travel_and_stay_bitwise():
    split = run_on_ranks(scenarios.layout_exactness, 4, ["experts_split_rows", "experts_split_cols"], DEFAULT_CAP)
    assert len(split) == 4 and all(rank["bytes"] > 0 for rank in split)
    assert split[0]["equal"] == {"experts_split_rows": True, "experts_split_cols": True}


def test_experts_whole_on_each_rank_are_orthogonalized_in_place_without_bytes():
    ranks = run_on_ranks(scenarios.layout_exactness, 4, ["experts_whole"], DEFAULT_CAP)
    assert [rank["bytes"] for rank in ranks] == [0, 0, 0, 0]
    assert len(ranks) == 4 and all(rank["ns_flops"] > 0 for rank in ranks)  # each rank ran its own expert
    assert ranks[0]["equal"] == {"experts_whole": True}


@pytest.fixture(scope="module")
def scratch_at_four_ranks() -> list[dict]:
    return run_on_ranks(scenarios.measured_scratch, 4, 600)


def test_a_real_step_allocates_exactly_the_scratch_the_plan_predicts(scratch_at_four_ranks):
    for rank in scratch_at_four_ranks:
        assert rank["predicted"] > 0
        assert rank["measured"] == [rank["predicted"]] * 2, rank
        assert rank["live_after"] == 0


def test_plan_report_predicts_the_scratch_measured_in_a_real_step(scratch_at_four_ranks, tmp_path, capsys):
    from dmuon.tools.plan_report import main

    shapes = tmp_path / "layouts.json"
    shapes.write_text(json.dumps([{"shape": list(shape), "shard_dim": dim} for _, shape, dim in scenarios.LAYOUT_CASES]))
    main(["--shapes", str(shapes), "--world-size", "4", "--max-batch-numel", "600", "--json"])
    predicted = json.loads(capsys.readouterr().out)["peak_scratch_bytes_per_rank"]
    measured = [max(rank["measured"]) for rank in scratch_at_four_ranks]
    assert predicted == max(measured)
