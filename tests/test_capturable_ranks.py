"""``capturable=True`` on real gloo ranks (issue 42, item 2): under a learning-rate and a
weight-decay schedule that change every step, with ``skip_nonfinite`` and a NaN grad on
one rank only, every local bit equals ``capturable=False``'s (parameters, every state
value, the skipped count), on FSDP at P = 1, 2 and 4 and on TorchTitan's 2 x 2 layouts
(HSDP, FSDP + TP, TP, EP, EP + FSDP), with NorMuon, cautious decay and Gram Newton-Schulz;
and a DCP checkpoint resumes bitwise on another world size. The workers:
tests/capturable_scenarios.py (one launch per world size and layout)."""

from __future__ import annotations

import pytest

from tests import capturable_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

VARIANTS = list(scenarios.VARIANTS)


@pytest.fixture(scope="module")
def fsdp() -> dict[int, list[dict]]:
    """Each rank's results on the FSDP layout, per world size (a NaN case from P = 2 on)."""
    return {world: run_on_ranks(scenarios.capturable_cases, world, "fsdp", ["plain"], world > 1)
            for world in (1, 2, 4)}


@pytest.fixture(scope="module")
def titan_layouts() -> list[dict]:
    """Each rank's results on the 2 x 2 layouts, every variant and the NaN case."""
    return run_on_ranks(scenarios.capturable_cases, 4, "mesh_2x2", VARIANTS, True)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_capturable_fsdp_steps_bitwise_like_capturable_off_under_schedules(fsdp, world):
    assert [rank["plain"]["differ"] for rank in fsdp[world]] == [[]] * world


@pytest.mark.parametrize("variant", VARIANTS)
def test_capturable_titan_layouts_step_bitwise_like_capturable_off(titan_layouts, variant):
    assert [rank[variant]["differ"] for rank in titan_layouts] == [[]] * 4


@pytest.mark.parametrize("layout, world", [("fsdp", 2), ("fsdp", 4), ("mesh_2x2", 4)])
def test_a_nan_on_one_rank_is_skipped_everywhere_alike_with_capturable(fsdp, titan_layouts, layout, world):
    ranks = fsdp[world] if layout == "fsdp" else titan_layouts
    assert [(rank["nan"]["differ"], rank["nan"]["skipped"]) for rank in ranks] == [([], 1)] * world


def test_a_capturable_dcp_checkpoint_resumes_bitwise_on_another_world_size(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    run_on_ranks(scenarios.checkpoint_save, 2, checkpoint, scenarios.BAD_STEP)
    for world in (4, 1):
        equal = run_on_ranks(scenarios.checkpoint_resume, world, checkpoint, scenarios.BAD_STEP)[0]
        assert set(equal.values()) == {True}, (world, equal)
