"""The AdamW part's moments in bf16 or int8 (``adamw_state_dtype``) stay bitwise exact across
world sizes (P = 1 vs 2 vs 4), on every layout, through DCP resharding and a step masked by
``skip_nonfinite`` (tests/adamw_state_scenarios.py says what runs)."""

from __future__ import annotations

import pytest

from tests import adamw_state_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

DTYPES = scenarios.STATE_DTYPES
FSDP_NAMES = list(scenarios.FSDP_SHAPES)
MESH_NAMES = list(scenarios.MESH_SHAPES)
ADAMW_MESH_NAMES = list(scenarios.MESH_CASES)


def _exact(figures: dict[str, dict]) -> dict[str, tuple[bool, bool]]:
    return {name: (f["weights"], f["state"]) for name, f in figures.items()}


def _forms(figures: dict[str, dict]) -> dict[str, str]:
    return {name: f["held_as"] for name, f in figures.items() if f["held_as"] != "muon"}


@pytest.fixture(scope="module")
def fsdp() -> dict[tuple[str, int], list[dict]]:
    """Every rank's agreement per (state dtype, world size)."""
    return {(dtype, world): run_on_ranks(scenarios.fsdp_exactness, world, dtype) for dtype in DTYPES
            for world in (2, 4)}


@pytest.fixture(scope="module")
def meshes() -> dict[str, list[dict]]:
    return {dtype: run_on_ranks(scenarios.mesh_exactness, 4, dtype) for dtype in DTYPES}


def _resume(tmp_path_factory, kind: str, dtype: str, saved: int, loaded: int) -> dict:
    """Rank 0's agreement after a DCP checkpoint of ``kind`` written on ``saved`` ranks after 2
    steps was resumed on ``loaded`` ranks for 2 more (every rank compares whole tensors)."""
    folder = str(tmp_path_factory.mktemp(f"adamw_{kind}_{dtype}_{saved}"))
    run_on_ranks(scenarios.checkpoint_save, saved, folder, kind, dtype, 2)
    return run_on_ranks(scenarios.checkpoint_resume, loaded, folder, kind, dtype, 2, 4)[0]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[tuple[str, str, int, int], dict]:
    """FSDP saved on 2 ranks, resumed on 4; the mesh layouts saved on 4 (2 x 2), resumed on 1."""
    return {(kind, dtype, saved, loaded): _resume(tmp_path_factory, kind, dtype, saved, loaded)
            for dtype in DTYPES for kind, saved, loaded in (("fsdp", 2, 4), ("mesh", 4, 1))}


@pytest.fixture(scope="module")
def masked() -> dict[tuple[str, str], list[dict]]:
    """Every rank's figures of a step with a NaN in rank 0's grad of one AdamW parameter, per
    (layout, state dtype): FSDP on 4 ranks (an empty shard), the mesh layouts on 2 x 2 (the
    NaN in one HSDP replica)."""
    return {(kind, dtype): run_on_ranks(scenarios.masked_step, 4, kind, dtype)
            for kind in ("fsdp", "mesh") for dtype in DTYPES}


# ------------------------------------------------------------------------------ FSDP


@pytest.mark.parametrize("case", FSDP_NAMES)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp_weights_and_adamw_state_are_bitwise_the_single_process_ones(fsdp, dtype, world, case):
    ranks = fsdp[dtype, world]
    assert [(rank[case]["weights"], rank[case]["state"]) for rank in ranks] == [(True, True)] * world


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp_adamw_moments_are_held_in_their_form(fsdp, dtype, world):
    # int8 where rows are 5+ elements, bf16 for rows of 3 under int8, fp32 for the vector.
    expected = scenarios.expected_forms(dtype, scenarios.FSDP_CASES)
    assert expected["norm"] == "float32" and expected["narrow"] == dtype.replace("int8", "bfloat16")
    assert [_forms(rank) for rank in fsdp[dtype, world]] == [expected] * world


# ------------------------------------------------------------------------------ 2 x 2 meshes


@pytest.mark.parametrize("case", MESH_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_mesh_layout_is_bitwise_the_single_process_run(meshes, dtype, case):
    assert [(rank[case]["weights"], rank[case]["state"]) for rank in meshes[dtype]] == [(True, True)] * 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_mesh_adamw_moments_fall_back_to_bf16_exactly_where_a_layout_cuts_rows_off_the_blocks(meshes, dtype):
    # One AdamW group holds every layout: the ranks choose the fallback from the global
    # shape and placements, alike on every rank.
    expected = scenarios.expected_forms(dtype, scenarios.MESH_CASES, scenarios.OFF_BLOCKS)
    assert {name for name, form in expected.items() if form == "bfloat16"} == (
        set(scenarios.OFF_BLOCKS) if dtype == "int8" else set(ADAMW_MESH_NAMES))
    assert [_forms(rank) for rank in meshes[dtype]] == [expected] * 4


# ------------------------------------------------------------------------------ DCP


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fsdp_dcp_checkpoint_resumes_bitwise_on_another_world_size(resumed, dtype):
    figures = resumed["fsdp", dtype, 2, 4]
    assert _forms(figures) == scenarios.expected_forms(dtype, scenarios.FSDP_CASES)
    assert _exact(figures) == dict.fromkeys(FSDP_NAMES, (True, True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_mesh_layouts_dcp_checkpoint_resumes_bitwise_on_one_rank(resumed, dtype):
    figures = resumed["mesh", dtype, 4, 1]
    assert _forms(figures) == scenarios.expected_forms(dtype, scenarios.MESH_CASES, scenarios.OFF_BLOCKS)
    assert _exact(figures) == dict.fromkeys(MESH_NAMES, (True, True))


@pytest.fixture(scope="module")
def resumed_more(tmp_path_factory) -> dict[tuple[str, str, int, int], dict]:
    """The other directions: FSDP 4 -> 2 and 2 -> 1, the mesh layouts 1 -> 4 (1 x 1 to 2 x 2)."""
    return {(kind, dtype, saved, loaded): _resume(tmp_path_factory, kind, dtype, saved, loaded)
            for dtype in DTYPES for kind, saved, loaded in (("fsdp", 4, 2), ("fsdp", 2, 1), ("mesh", 1, 4))}


@pytest.mark.extended
@pytest.mark.parametrize("kind, saved, loaded", [("fsdp", 4, 2), ("fsdp", 2, 1), ("mesh", 1, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dcp_checkpoint_resumes_bitwise_in_the_other_directions(resumed_more, dtype, kind, saved, loaded):
    figures = resumed_more[kind, dtype, saved, loaded]
    names, cases = (FSDP_NAMES, scenarios.FSDP_CASES) if kind == "fsdp" else (MESH_NAMES, scenarios.MESH_CASES)
    assert _forms(figures) == scenarios.expected_forms(dtype, cases, scenarios.OFF_BLOCKS)
    assert _exact(figures) == dict.fromkeys(names, (True, True))


# ------------------------------------------------------------------------------ masks


@pytest.mark.parametrize("kind", ["fsdp", "mesh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_in_one_ranks_adamw_grad_changes_no_bit_on_any_rank(masked, dtype, kind):
    ranks = masked[kind, dtype]
    assert [(rank["changed"], rank["skipped"]) for rank in ranks] == [([], 1)] * 4


@pytest.mark.parametrize("kind", ["fsdp", "mesh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_step_after_a_skipped_one_is_the_single_process_run_without_it(masked, dtype, kind):
    ranks = masked[kind, dtype]
    names = FSDP_NAMES if kind == "fsdp" else MESH_NAMES
    assert [_exact(rank["agreement"]) for rank in ranks] == [dict.fromkeys(names, (True, True))] * 4
    assert _forms(ranks[0]["agreement"]) == scenarios.expected_forms(
        dtype, scenarios.FSDP_CASES if kind == "fsdp" else scenarios.MESH_CASES, scenarios.OFF_BLOCKS)
