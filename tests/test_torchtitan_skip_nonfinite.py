"""``[optimizer] skip_nonfinite = true`` in a TorchTitan 0.2.2 CPU run (issue 42, item 4): a
NaN written into one rank's grad at step 3 (``tests.titan_hooks.grad_fault``) skips that
step's update on every rank, the run goes on, and its step-6 checkpoint equals, bit for
bit, a run whose optimizer was never called at step 3 (same data, same LR schedule)."""

from __future__ import annotations

import math

import pytest

from tests.checkpoints import assert_same_checkpoints, checkpoint_dir
from tests.titan_hooks.grad_fault import NAN_ENV, NO_STEP_ENV
from tests.titan_runs import DMUON_TOML, torchrun

pytestmark = pytest.mark.torchrun

STEPS, BAD_STEP = 6, 3


def _run(folder, short_run_args, env):
    args = (*short_run_args, "--training.steps", str(STEPS), "--optimizer.skip_nonfinite",
            "--checkpoint.enable", "--checkpoint.interval", str(STEPS))
    return torchrun(DMUON_TOML, folder, *args, env=env)


def test_a_nan_on_one_rank_skips_that_step_everywhere_and_the_run_goes_on_as_if_it_never_stepped(
        short_run_args, tmp_path):
    skipped, out = _run(tmp_path / "nan", short_run_args, {NAN_ENV: f"{BAD_STEP}:1"})
    never, _ = _run(tmp_path / "never", short_run_args, {NO_STEP_ENV: str(BAD_STEP)})
    assert sorted(skipped.train_loss) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in skipped.train_loss.values())
    assert skipped.train_loss == never.train_loss
    assert "skipped: 1" in out  # counted one step late, on the step lines after it
    assert_same_checkpoints(checkpoint_dir(tmp_path / "nan", STEPS), checkpoint_dir(tmp_path / "never", STEPS),
                            tmp_path / "loaded")
