"""``capturable=True`` on real gloo ranks (issue 42, item 2): under a learning-rate and a
weight-decay schedule that change every step, with ``skip_nonfinite`` and a NaN grad on
one rank only, every local bit equals ``capturable=False``'s (parameters, every state
value, the skipped count), on FSDP at P = 1, 2 and 4 and on TorchTitan's 2 x 2 layouts
(HSDP, FSDP + TP, TP, EP, EP + FSDP), with NorMuon, cautious decay and Gram Newton-Schulz.
The workers: tests/capturable_scenarios.py."""

from __future__ import annotations

import pytest

from tests import capturable_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 4])
def test_capturable_fsdp_steps_bitwise_like_capturable_off_under_schedules(world):
    ranks = run_on_ranks(scenarios.capturable_matches, world, "fsdp", "plain")
    assert [r["differ"] for r in ranks] == [[]] * world


@pytest.mark.parametrize("variant", ["plain", "normuon", "cautious", "nesterov_off_gram"])
def test_capturable_titan_layouts_step_bitwise_like_capturable_off(variant):
    ranks = run_on_ranks(scenarios.capturable_matches, 4, "mesh_2x2", variant)
    assert [r["differ"] for r in ranks] == [[]] * 4


@pytest.mark.parametrize("layout, world", [("fsdp", 2), ("fsdp", 4), ("mesh_2x2", 4)])
def test_a_nan_on_one_rank_is_skipped_everywhere_alike_with_capturable(layout, world):
    ranks = run_on_ranks(scenarios.capturable_matches, world, layout, "plain", world - 1)
    assert [(r["differ"], r["skipped"]) for r in ranks] == [([], 1)] * world


def test_a_capturable_dcp_checkpoint_resumes_bitwise_on_another_world_size(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    run_on_ranks(scenarios.checkpoint_save, 2, checkpoint, scenarios.BAD_STEP)
    for world in (4, 1):
        equal = run_on_ranks(scenarios.checkpoint_resume, world, checkpoint, scenarios.BAD_STEP)[0]
        assert set(equal.values()) == {True}, (world, equal)
