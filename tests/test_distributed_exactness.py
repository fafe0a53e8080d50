"""DMuon on P gloo ranks equals single-process DMuon on the full tensors, bit for bit.

The oracle runs in the worker too (one thread, plain tensors), after the distributed
run. Cases: square, tall and wide matrices, an uneven split, a matrix with an empty
shard on the last rank (at P = 4), a 3-D expert weight, two Muon groups with different
lr and momentum, and an AdamW group, all in one optimizer; each with Newton-Schulz in bf16 and in fp32
(``ns_dtype``), since both must be exact. The same cases again with NorMuon and cautious
weight decay on, on every layout and both paths, and with split_rows (attention heads).
The base cases once more with Gram Newton-Schulz (``ns_algorithm="gram"``).
"""

from __future__ import annotations

import pytest

from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

WORLD_SIZES = (1, 2, 4)
CASE_NAMES = [name for name, _, _ in scenarios.CASES]


@pytest.fixture(scope="module")
def every_dtype() -> dict[int, dict[str, dict]]:
    """Per world size, per ns_dtype: the exactness scenario's figures (rank 0)."""
    return {world: run_on_ranks(scenarios.per_ns_dtype, world, scenarios.exactness)[0] for world in WORLD_SIZES}


@pytest.fixture(scope="module")
def results(every_dtype) -> dict[int, dict]:
    """The figures with Newton-Schulz in bf16 (what the checks of paths and bytes read)."""
    return {world: by_dtype["bfloat16"] for world, by_dtype in every_dtype.items()}


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_fast_path_is_bitwise_equal_to_single_process(every_dtype, ns_dtype, world, case):
    assert every_dtype[world][ns_dtype][("fsdp", "all_to_all")][case]


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_reference_path_is_bitwise_equal_to_single_process(every_dtype, ns_dtype, world, case):
    assert every_dtype[world][ns_dtype][("fsdp", "redistribute")][case]


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_hsdp_and_fsdp_tp_are_bitwise_equal_on_the_path_comm_asks_for(every_dtype, ns_dtype, layout, comm):
    four = every_dtype[4][ns_dtype]
    assert four[(layout, comm)] == dict.fromkeys(CASE_NAMES, True)
    assert set(four[(layout, comm, "paths")].values()) == {comm}


def test_the_two_compute_dtypes_give_different_weights(every_dtype):
    """So the bitwise checks above compare two different computations, not one twice."""
    sharded = {dtype: every_dtype[2][dtype][("fsdp", "all_to_all", "checksum")] for dtype in scenarios.NS_DTYPES}
    assert sharded["bfloat16"] != sharded["float32"]


def test_the_cases_include_an_empty_shard_at_four_ranks(results):
    rows = results[4][("fsdp", "all_to_all", "local_rows")]
    assert rows["empty_shard"] == 1 and rows["experts_3d"] == 1  # rank 0 of (1, 1, 1, 0)


def test_shard0_matrices_take_the_fast_path_on_several_ranks(results):
    assert set(results[2][("fsdp", "all_to_all", "paths")].values()) == {"all_to_all"}
    assert set(results[1][("fsdp", "all_to_all", "paths")].values()) == {"local"}


def test_only_the_fast_path_sends_owner_traffic(results):
    assert results[2][("fsdp", "all_to_all", "bytes")] > 0
    assert results[2][("fsdp", "redistribute", "bytes")] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_real_fully_shard_training_matches_single_process(world):
    equal = run_on_ranks(scenarios.fsdp2_training, world)[0]
    assert equal == dict.fromkeys(scenarios.TINY_LM_PARAMS, True)


# ------------------------------------------------------------ Gram Newton-Schulz


@pytest.fixture(scope="module")
def gram() -> dict[int, dict]:
    """Per world size: the exactness scenario's figures with Gram Newton-Schulz (rank 0)."""
    return {world: run_on_ranks(scenarios.exactness, world, "float32", "gram")[0] for world in WORLD_SIZES}


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gram_newton_schulz_is_bitwise_equal_to_single_process_on_every_layout_and_path(gram, world):
    runs = [key for key in gram[world] if len(key) == 2]
    assert len(runs) == (6 if world == 4 else 2)  # fsdp (and hsdp, fsdp_tp at 4) x both paths
    assert {run: gram[world][run] for run in runs} == {run: dict.fromkeys(CASE_NAMES, True) for run in runs}


# ------------------------------------------------------------ NorMuon and cautious weight decay


@pytest.fixture(scope="module")
def variants() -> dict[int, dict[str, dict]]:
    """Per world size, per ns_dtype: the variant scenario's figures (rank 0)."""
    return {world: run_on_ranks(scenarios.per_ns_dtype, world, scenarios.variants_exactness)[0]
            for world in WORLD_SIZES}


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_normuon_and_cautious_weight_decay_are_bitwise_equal_to_single_process(variants, ns_dtype, world, comm):
    assert variants[world][ns_dtype][("fsdp", comm)] == dict.fromkeys(CASE_NAMES, True)


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_ranks_normuon_state_equals_the_single_process_state(variants, world, comm):
    moments = variants[world]["bfloat16"][("fsdp", comm, "moments")]
    assert moments and all(moments.values())


def test_the_normuon_cases_take_the_fast_path_on_several_ranks(variants):
    assert set(variants[4]["bfloat16"][("fsdp", "all_to_all", "paths")].values()) == {"all_to_all"}


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_normuon_and_cautious_weight_decay_under_hsdp_and_fsdp_tp_are_bitwise_equal(variants, ns_dtype, layout, comm):
    four = variants[4][ns_dtype]
    assert four[(layout, comm)] == dict.fromkeys(CASE_NAMES, True)
    assert set(four[(layout, comm, "paths")].values()) == {comm}


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_every_ranks_normuon_state_under_hsdp_and_fsdp_tp_equals_the_single_process_state(variants, layout, comm):
    moments = variants[4]["bfloat16"][(layout, comm, "moments")]
    assert moments and all(moments.values())


@pytest.mark.parametrize("comm", ["all_to_all", "redistribute"])
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("ns_dtype", scenarios.NS_DTYPES)
def test_normuon_with_split_rows_is_bitwise_equal_to_single_process_state_included(variants, ns_dtype, world, comm):
    assert variants[world][ns_dtype][("split_rows", comm)] == dict.fromkeys(scenarios.SPLIT_ROWS_CASES, True)
