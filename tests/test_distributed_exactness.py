"""DMuon on P gloo ranks equals single-process DMuon on the full tensors, bit for bit.

The oracle runs in the worker too (one thread, plain tensors), after the distributed
run. Cases: square, tall and wide matrices, an uneven split, a matrix with an empty
shard on the last rank (at P = 4), a 3-D expert weight, two Muon groups with different
lr and momentum, and an AdamW group, all in one optimizer; each with Newton-Schulz in bf16 and in fp32
(``ns_dtype``), since both must be exact. The same cases again with NorMuon and cautious
weight decay on, on every layout and both paths, and with split_rows (attention heads).
The base cases once more with Gram Newton-Schulz (``ns_algorithm="gram"``).

Every rank reports, and every rank is judged: its local shard against the matching
block of the single-process result (under HSDP, ranks 2 and 3 hold the second replica).
P = 1, where every parameter takes the local path, is ``tests/test_one_rank.py``.
"""

from __future__ import annotations

import pytest

from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

WORLD_SIZES = (2, 4)
CASE_NAMES = [name for name, _, _ in scenarios.CASES]
ALL_EQUAL = dict.fromkeys(CASE_NAMES, True)


def by_dtype(ranks: list[dict[str, dict]]) -> dict[str, list[dict]]:
    """Every rank's ``{ns_dtype: figures}`` as ``{ns_dtype: [rank 0's, rank 1's, ...]}``."""
    return {dtype: [rank[dtype] for rank in ranks] for dtype in scenarios.NS_DTYPES}


def paths_of(ranks: list[dict], run: tuple[str, str]) -> set[str]:
    """The paths any rank took in ``run`` (a ``(layout, comm)`` pair)."""
    return {path for rank in ranks for path in rank[(*run, "paths")].values()}


@pytest.fixture(scope="module")
def every_dtype() -> dict[int, dict[str, list[dict]]]:
    """Per world size, per ns_dtype: every rank's figures of the exactness scenario."""
    return {world: by_dtype(run_on_ranks(scenarios.per_ns_dtype, world, scenarios.exactness)) for world in WORLD_SIZES}


@pytest.fixture(scope="module")
def results(every_dtype) -> dict[int, list[dict]]:
    """The figures with Newton-Schulz in bf16 (what the checks of paths and bytes read)."""
    return {world: ranks["bfloat16"] for world, ranks in every_dtype.items()}


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_fast_path_is_bitwise_equal_to_single_process(every_dtype, ns_dtype, world, case):
    assert [rank[("fsdp", "all_to_all")][case] for rank in every_dtype[world][ns_dtype]] == [True] * world


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_reference_path_is_bitwise_equal_to_single_process(every_dtype, ns_dtype, world, case):
    assert [rank[("fsdp", "redistribute")][case] for rank in every_dtype[world][ns_dtype]] == [True] * world


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_hsdp_and_fsdp_tp_are_bitwise_equal_on_the_path_comm_asks_for(every_dtype, ns_dtype, layout, comm):
    four = every_dtype[4][ns_dtype]
    assert [rank[(layout, comm)] for rank in four] == [ALL_EQUAL] * 4
    assert paths_of(four, (layout, comm)) == {comm}


def test_the_two_compute_dtypes_give_different_weights(every_dtype):
    """So the bitwise checks above compare two different computations, not one twice."""
    sharded = {dtype: every_dtype[2][dtype][0][("fsdp", "all_to_all", "checksum")] for dtype in scenarios.NS_DTYPES}
    assert sharded["bfloat16"] != sharded["float32"]


def test_the_cases_include_an_empty_shard_at_four_ranks(results):
    rows = [rank[("fsdp", "all_to_all", "local_rows")] for rank in results[4]]
    assert [r["empty_shard"] for r in rows] == [r["experts_3d"] for r in rows] == [1, 1, 1, 0]


def test_shard0_matrices_take_the_fast_path_on_several_ranks(results):
    assert paths_of(results[2], ("fsdp", "all_to_all")) == {"all_to_all"}


def test_only_the_fast_path_sends_owner_traffic(results):
    assert all(rank[("fsdp", "all_to_all", "bytes")] > 0 for rank in results[2])
    assert [rank[("fsdp", "redistribute", "bytes")] for rank in results[2]] == [0, 0]


@pytest.mark.parametrize("world", [2, 4])
def test_real_fully_shard_training_matches_single_process(world):
    assert run_on_ranks(scenarios.fsdp2_training, world) == [dict.fromkeys(scenarios.TINY_LM_PARAMS, True)] * world


# ------------------------------------------------------------ Gram Newton-Schulz


@pytest.fixture(scope="module")
def gram() -> dict[int, list[dict]]:
    """Per world size: every rank's figures of the exactness scenario with Gram Newton-Schulz."""
    return {world: run_on_ranks(scenarios.exactness, world, "float32", "gram") for world in WORLD_SIZES}


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gram_newton_schulz_is_bitwise_equal_to_single_process_on_every_layout_and_path(gram, world):
    runs = [key for key in gram[world][0] if len(key) == 2]
    assert len(runs) == (6 if world == 4 else 2)  # fsdp (and hsdp, fsdp_tp at 4) x both paths
    assert [{run: rank[run] for run in runs} for rank in gram[world]] == [dict.fromkeys(runs, ALL_EQUAL)] * world


# ------------------------------------------------------------ NorMuon and cautious weight decay


@pytest.fixture(scope="module")
def variants() -> dict[int, dict[str, list[dict]]]:
    """Per world size, per ns_dtype: every rank's figures of the variant scenario."""
    return {world: by_dtype(run_on_ranks(scenarios.per_ns_dtype, world, scenarios.variants_exactness))
            for world in WORLD_SIZES}


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_normuon_and_cautious_weight_decay_are_bitwise_equal_to_single_process(variants, ns_dtype, world, comm):
    assert [rank[("fsdp", comm)] for rank in variants[world][ns_dtype]] == [ALL_EQUAL] * world


def _all_true(moments: dict[str, bool]) -> bool:
    return bool(moments) and all(moments.values())


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_ranks_normuon_state_equals_the_single_process_state(variants, world, comm):
    assert [_all_true(rank[("fsdp", comm, "moments")]) for rank in variants[world]["bfloat16"]] == [True] * world


def test_the_normuon_cases_take_the_fast_path_on_several_ranks(variants):
    assert paths_of(variants[4]["bfloat16"], ("fsdp", "all_to_all")) == {"all_to_all"}


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_normuon_and_cautious_weight_decay_under_hsdp_and_fsdp_tp_are_bitwise_equal(variants, ns_dtype, layout, comm):
    four = variants[4][ns_dtype]
    assert [rank[(layout, comm)] for rank in four] == [ALL_EQUAL] * 4
    assert paths_of(four, (layout, comm)) == {comm}


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_every_ranks_normuon_state_under_hsdp_and_fsdp_tp_equals_the_single_process_state(variants, layout, comm):
    assert [_all_true(rank[(layout, comm, "moments")]) for rank in variants[4]["bfloat16"]] == [True] * 4


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_normuon_with_split_rows_is_bitwise_equal_to_single_process_state_included(variants, ns_dtype, world, comm):
    expected = dict.fromkeys(scenarios.SPLIT_ROWS_CASES, True)
    assert [rank[("split_rows", comm)] for rank in variants[world][ns_dtype]] == [expected] * world
