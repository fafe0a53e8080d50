"""Momentum in bf16 or int8 stays bitwise exact across world sizes (P = 1 vs 2 vs 4), on
every layout, through DCP resharding (tests/momentum_scenarios.py says what runs)."""

from __future__ import annotations

import pytest

from tests import momentum_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

DTYPES = scenarios.MOMENTUM_DTYPES
FSDP_NAMES = list(scenarios.FSDP_CASES)
MESH_NAMES = [name for name, _, _ in scenarios.MESH_MOMENTUM_CASES]


@pytest.fixture(scope="module")
def fsdp() -> dict[tuple[str, int], list[dict]]:
    """Every rank's agreement per (momentum dtype, world size)."""
    return {(dtype, world): run_on_ranks(scenarios.fsdp_exactness, world, dtype) for dtype in DTYPES
            for world in (2, 4)}


@pytest.fixture(scope="module")
def meshes() -> dict[str, list[dict]]:
    return {dtype: run_on_ranks(scenarios.mesh_exactness, 4, dtype) for dtype in DTYPES}


@pytest.fixture(scope="module")
def split_meshes() -> dict[str, list[dict]]:
    """The mesh layouts with Newton-Schulz split across HSDP's replicas."""
    return {dtype: run_on_ranks(scenarios.mesh_exactness, 4, dtype, True) for dtype in DTYPES}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[tuple[str, int, int], dict]:
    """Rank 0's agreement after a DCP checkpoint written on ``saved`` ranks after 2 steps was
    resumed on ``loaded`` ranks for 2 more (every rank compares whole tensors)."""
    out = {}
    for dtype in DTYPES:
        for saved, loaded in ((2, 4), (2, 1), (4, 2)):
            folder = str(tmp_path_factory.mktemp(f"momentum_{dtype}_{saved}"))
            run_on_ranks(scenarios.checkpoint_save, saved, folder, dtype, 2)
            out[dtype, saved, loaded] = run_on_ranks(scenarios.checkpoint_resume, loaded, folder, dtype, 2, 4)[0]
    return out


@pytest.fixture(scope="module")
def mesh_resumed(tmp_path_factory) -> dict[str, dict]:
    """Every mesh layout's DCP checkpoint written on 4 ranks (2 x 2) after 2 steps, resumed
    on 1 rank for 2 more."""
    out = {}
    for dtype in DTYPES:
        folder = str(tmp_path_factory.mktemp(f"mesh_momentum_{dtype}"))
        run_on_ranks(scenarios.mesh_checkpoint_save, 4, folder, dtype, 2)
        out[dtype] = run_on_ranks(scenarios.mesh_checkpoint_resume, 1, folder, dtype, 2, 4)[0]
    return out


@pytest.mark.parametrize("case", FSDP_NAMES)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp_weights_and_momentum_are_bitwise_the_single_process_ones(fsdp, dtype, world, case):
    ranks = fsdp[dtype, world]
    assert [rank[case]["weights"] for rank in ranks] == [True] * world
    assert [rank[case]["momentum"] for rank in ranks] == [True] * world
    assert ranks[0][case]["held_as"] == dtype


@pytest.mark.parametrize("case", MESH_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_mesh_layout_is_bitwise_the_single_process_run(meshes, dtype, case):
    assert [(rank[case]["weights"], rank[case]["momentum"]) for rank in meshes[dtype]] == [(True, True)] * 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_replica_that_never_sends_a_block_still_updates_its_momentum(split_meshes, dtype):
    hsdp = [name for name in MESH_NAMES if name.startswith("hsdp")]
    assert hsdp
    assert {name: [(rank[name]["weights"], rank[name]["momentum"]) for rank in split_meshes[dtype]]
            for name in hsdp} == dict.fromkeys(hsdp, [(True, True)] * 4)


def test_int8_momentum_is_kept_in_bf16_exactly_where_a_layout_cuts_rows_off_the_blocks(meshes):
    held = {name: figures["held_as"] for name, figures in meshes["int8"][0].items()}
    assert {name for name, dtype in held.items() if dtype == "bfloat16"} == set(scenarios.OFF_BLOCKS)
    assert {name for name, dtype in held.items() if dtype == "int8"} == set(MESH_NAMES) - set(scenarios.OFF_BLOCKS)


@pytest.mark.parametrize("saved, loaded", [(2, 4), (2, 1), (4, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dcp_checkpoint_resumes_bitwise_on_another_world_size(resumed, dtype, saved, loaded):
    figures = resumed[dtype, saved, loaded]
    assert {name: (f["weights"], f["momentum"], f["held_as"]) for name, f in figures.items()} == {
        name: (True, True, dtype) for name in FSDP_NAMES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_mesh_layouts_dcp_checkpoint_resumes_bitwise_on_one_rank(mesh_resumed, dtype):
    figures = mesh_resumed[dtype]
    assert {name: (f["weights"], f["momentum"]) for name, f in figures.items()} == dict.fromkeys(MESH_NAMES,
                                                                                                 (True, True))


@pytest.fixture(scope="module")
def loaded_as(tmp_path_factory) -> dict[tuple, dict]:
    """Rank 0's answer of a DCP checkpoint written on 2 ranks with one momentum dtype and
    loaded on 2 ranks into an optimizer with another."""
    out = {}
    for saved in (None, "int8"):
        folder = str(tmp_path_factory.mktemp(f"momentum_saved_{saved}"))
        run_on_ranks(scenarios.checkpoint_save, 2, folder, saved, 2)
        for loaded in (("bfloat16",) if saved is None else (None,)):
            out[saved, loaded] = run_on_ranks(scenarios.checkpoint_load_as, 2, folder, saved, loaded)[0]
    folder = str(tmp_path_factory.mktemp("momentum_saved_bf16"))
    run_on_ranks(scenarios.checkpoint_save, 2, folder, "bfloat16", 2)
    out["bfloat16", "int8"] = run_on_ranks(scenarios.checkpoint_load_as, 2, folder, "bfloat16", "int8")[0]
    return out


def test_a_dcp_load_between_float_momentum_dtypes_casts_the_saved_momentum(loaded_as):
    assert loaded_as[None, "bfloat16"] == {"error": None, "momentum": dict.fromkeys(FSDP_NAMES, True)}


@pytest.mark.parametrize("saved, loaded, missing", [("int8", None, "momentum_buffer"),
                                                    ("bfloat16", "int8", "momentum_int8")])
def test_a_dcp_load_between_int8_and_a_float_momentum_fails_naming_the_parameter_and_key(loaded_as, saved, loaded,
                                                                                         missing):
    error = loaded_as[saved, loaded]["error"]
    assert error is not None and "Missing key" in error and f"blocks.{missing}" in error


# ------------------------------------------------- a plain state dict across the bf16 fallback (issue 60, item 4)

def test_a_plain_resume_on_the_same_layout_keeps_the_fallbacks_bf16_momentum():
    # One int8 group holding every mesh layout: the off-block ones keep bf16 through
    # load_state_dict (their layout's form, not the group's), and the run stays bitwise.
    figures = run_on_ranks(scenarios.mesh_plain_resume, 4, "int8", 2, 3)[0]
    assert {n: (f["weights"], f["momentum"]) for n, f in figures.items()} == dict.fromkeys(MESH_NAMES, (True, True))
    assert {n for n, f in figures.items() if f["held_as"] == "bfloat16"} == set(scenarios.OFF_BLOCKS)


def test_int8_resumes_on_a_layout_without_the_fallback_converting_and_naming_each_parameter():
    # Saved on a 2 x 2 mesh (the off-block ones in bf16), loaded whole into one process (every
    # row whole: int8 for all): those are converted once, with a log line naming them.
    saved = run_on_ranks(scenarios.mesh_full_state, 4, "int8", 2)[0]
    resumed = run_on_ranks(scenarios.resume_whole, 1, saved, "int8", 2, 4)[0]
    assert {n: (f["weights"], f["momentum"], f["held_as"]) for n, f in resumed["agreement"].items()} == dict.fromkeys(
        MESH_NAMES, (True, True, "int8"))
    assert resumed["log"] == [f"DMuon: momentum converted on resume from bfloat16 to int8: "
                              f"{', '.join(sorted(scenarios.OFF_BLOCKS))}"]


def test_a_plain_resume_from_float_momentum_makes_the_fallbacks_bf16_not_the_groups_int8():
    # float32 momentum saved on 2 ranks, loaded into an int8 group on the same layout: the
    # conversion makes each momentum in the form its layout keeps, the column cut off the
    # blocks in bf16 (issue 67, item 5).
    figures = run_on_ranks(scenarios.line_plain_resume_from_float, 2, 2)
    assert figures == [{"cut": {"held_as": "bfloat16", "rounded_once": True},
                        "rows": {"held_as": "int8", "rounded_once": True}}] * 2
