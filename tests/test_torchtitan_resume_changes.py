"""Resuming a TorchTitan 0.2.x job with changed ``[optimizer]`` options (issue 43, items 1-4):
real 2-rank ``torchrun`` runs from the step-5 checkpoint of the shared ``dmuon_run``.

* options that may change (``ns_steps``, ``momentum``, ``adamw_lr``, ``qk_clip_threshold``)
  are applied from the config and logged on every rank, and the run trains with them;
* options that change the state's layout (``normuon``, ``split_attention_heads``) stop the
  job before step 6 on every rank, naming the field and the ``exclude_from_loading`` fix;
* an optimizer switch (DMuon <-> AdamW) stops with the recipe, and the recipe trains.

The unchanged resume (bit for bit) is ``test_torchtitan_e2e.py``'s.
"""

from __future__ import annotations

import pytest

from tests.checkpoints import checkpoint_dir, load_checkpoint
from tests.titan_runs import ADAMW_TOML, attempt_output, copy_checkpoint, DMUON_TOML, torchrun

pytestmark = pytest.mark.torchrun

RESUME_ARGS = ("--checkpoint.enable", "--checkpoint.interval", "5")
RECIPE = "--checkpoint.exclude_from_loading optimizer,lr_scheduler"


def resume(source, tmp_path, toml, short_run_args, *overrides, check=True):
    run = tmp_path / "resumed"
    copy_checkpoint(source, 5, run)
    log, out = torchrun(toml, run, *short_run_args, *RESUME_ARGS, *overrides, check=check)
    return log, out, run


def every_rank(run) -> list[str]:
    return [attempt_output(run, attempt=0, rank=rank) for rank in (0, 1)]


def test_safe_options_changed_on_resume_are_applied_logged_on_every_rank_and_trained_with(
        dmuon_run, short_run_args, tmp_path):
    full, folder = dmuon_run
    log, _, run = resume(folder, tmp_path, DMUON_TOML, short_run_args, "--optimizer.ns_steps", "1",
                         "--optimizer.momentum", "0.5", "--optimizer.adamw_lr", "0.01",
                         "--optimizer.qk_clip_threshold", "0.1")
    for text in every_rank(run):
        assert "DMuon: changed on resume: ns_steps 5 -> 1 (group 0)" in text
        assert "DMuon: changed on resume: momentum 0.95 -> 0.5 (group 0)" in text
        assert "DMuon: changed on resume: qk_clip_threshold None -> 0.1 (group 0)" in text
        assert "DMuon: changed on resume: lr 0.002 -> 0.01 (group 1)" in text
    assert sorted(log.train_loss) == [6, 7, 8, 9, 10]
    assert log.train_loss[6] == full.train_loss[6]  # step 6's loss is taken before its update
    assert all(log.train_loss[s] != full.train_loss[s] for s in range(7, 11)), (log.train_loss, full.train_loss)
    assert log.telemetry[6]["qk_clipped_heads"] > 0  # QK-clip is on at 0.1
    saved = load_checkpoint(checkpoint_dir(run, 10), tmp_path / "scratch")["optimizer"]  # flat keys
    assert saved["param_groups.layers.0.attention.wq.weight.ns_steps"] == 1
    assert saved["param_groups.layers.0.attention.wq.weight.momentum"] == 0.5
    assert saved["param_groups.tok_embeddings.weight.initial_lr"] == 0.01


@pytest.mark.parametrize(("flag", "named", "fix"), [
    ("--optimizer.normuon", "normuon = true now, false in the checkpoint",
     "--checkpoint.exclude_from_loading optimizer;"),
    ("--optimizer.split_attention_heads", "split_attention_heads changed", RECIPE),
])
def test_a_layout_change_stops_every_rank_before_step_6_naming_the_field_and_the_fix(
        dmuon_run, short_run_args, tmp_path, flag, named, fix):
    _, folder = dmuon_run
    log, _, run = resume(folder, tmp_path, DMUON_TOML, short_run_args, flag, check=False)
    assert not log.train_loss
    for text in every_rank(run):
        assert named in text and fix in text, text[-3000:]
        assert "Missing key" not in text and "step:  6" not in text


@pytest.mark.extended
def test_a_dmuon_checkpoint_resumed_with_adamw_stops_with_the_recipe_which_then_trains(
        dmuon_run, short_run_args, tmp_path):
    full, folder = dmuon_run
    log, out, _ = resume(folder, tmp_path / "refused", ADAMW_TOML, short_run_args, check=False)
    assert not log.train_loss
    assert "optimizer state written by DMuon, and this job trains with another optimizer" in out
    assert RECIPE in out and "Missing key" not in out
    switched, _, _ = resume(folder, tmp_path / "switched", ADAMW_TOML, short_run_args, *RECIPE.split())
    assert sorted(switched.train_loss) == [6, 7, 8, 9, 10]
    assert switched.train_loss[6] == full.train_loss[6]  # DMuon's weights were loaded
    assert switched.train_loss[10] < full.train_loss[1] - 0.5


@pytest.fixture(scope="module")
def adamw_run(tmp_path_factory, short_run_args):
    folder = tmp_path_factory.mktemp("adamw_run")
    log, _ = torchrun(ADAMW_TOML, folder, *short_run_args, "--training.steps", "5", *RESUME_ARGS)
    return log, folder


@pytest.mark.extended
def test_an_adamw_checkpoint_resumed_with_dmuon_stops_with_the_recipe_which_then_trains(
        adamw_run, short_run_args, tmp_path):
    adamw, folder = adamw_run
    log, out, _ = resume(folder, tmp_path / "refused", DMUON_TOML, short_run_args, check=False)
    assert not log.train_loss
    assert "optimizer state written by another optimizer (AdamW/Adam), and this job trains with DMuon" in out
    assert RECIPE in out and "Missing key" not in out
    switched, _, _ = resume(folder, tmp_path / "switched", DMUON_TOML, short_run_args, *RECIPE.split())
    assert sorted(switched.train_loss) == [6, 7, 8, 9, 10]
    assert switched.train_loss[10] < adamw.train_loss[1] - 0.5
