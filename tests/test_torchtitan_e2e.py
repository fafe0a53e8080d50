"""End-to-end: real ``torchrun`` TorchTitan runs of the llama3 debug model on CPU ranks.

Launches go through ``tests/titan_runs.py`` (``torchrun --standalone``, a timeout,
the whole process group killed if a run hangs). Runs are short (<= 10 steps at
seq_len 128); one 2-rank run with checkpoints (the ``dmuon_run`` fixture in
``conftest.py``) is shared by several tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.checkpoints import (
    assert_same_checkpoints,
    assert_same_tensors,
    checkpoint_dir,
    load_checkpoint,
    NON_MODEL_STATES,
)
from tests.titan_runs import ADAMW_TOML, copy_checkpoint, DMUON_TOML, torchrun

pytestmark = pytest.mark.torchrun


def test_dmuon_loss_at_the_last_step_is_clearly_below_the_first(dmuon_run):
    log, _ = dmuon_run
    assert sorted(log.train_loss) == list(range(1, 11))
    assert log.train_loss[10] < log.train_loss[1] - 0.5, log.train_loss


def test_with_telemetry_every_dmuon_step_line_reports_the_optimizers_figures(dmuon_run):
    log, _ = dmuon_run  # the demo config sets [optimizer] telemetry = true
    assert sorted(log.telemetry) == list(range(1, 11))
    for step, figures in log.telemetry.items():
        assert 0 < figures["newton_schulz_ms"] <= figures["optimizer_step_ms"], (step, figures)
        assert figures["sent_mib"] > 0, (step, figures)  # 2 ranks: matrices travel to their owners
        for part in ("muon", "adamw"):
            assert 0 < figures[f"{part}_update_rms"] < figures[f"{part}_weight_rms"], (step, figures)


# The whole step line TorchTitan 0.2.2 prints, and nothing after it.
STOCK_STEP_LINE = re.compile(
    r"- step:\s*\d+  loss:\s*[0-9.]+  grad_norm:\s*[0-9.]+  memory:\s*[0-9.]+GiB\([0-9.]+%\)  "
    r"tps: [0-9,]+  tflops: [0-9.,]+  mfu: [0-9.]+%$"
)


def test_with_telemetry_off_dmuon_step_lines_are_exactly_torchtitans(short_run_args, tmp_path):
    log, out = torchrun(DMUON_TOML, tmp_path, *short_run_args, "--training.steps", "2", "--optimizer.no-telemetry")
    step_lines = [line for line in out.splitlines() if " - step:" in line]
    assert len(step_lines) == 2 and sorted(log.train_loss) == [1, 2]
    assert all(STOCK_STEP_LINE.search(line) for line in step_lines), step_lines
    assert log.telemetry == {}


def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_run_bit_for_bit(dmuon_run, short_run_args, tmp_path):
    full, full_folder = dmuon_run
    run = tmp_path / "resumed"
    copy_checkpoint(full_folder, 5, run)
    resumed, out = torchrun(DMUON_TOML, run, *short_run_args,
                            "--checkpoint.enable", "--checkpoint.interval", "5")
    assert "Loading the checkpoint" in out and "step-5" in out
    assert sorted(resumed.train_loss) == [6, 7, 8, 9, 10]
    assert {s: resumed.train_loss[s] for s in range(6, 11)} == {s: full.train_loss[s] for s in range(6, 11)}
    # The losses are printed with 5 decimals; the step-10 checkpoints hold every bit:
    # the weights, the momentum buffers and the AdamW moments.
    assert_same_checkpoints(checkpoint_dir(run, 10), checkpoint_dir(full_folder, 10), tmp_path / "loaded")


@pytest.mark.extended
def test_an_async_checkpoint_resumes_to_the_uninterrupted_runs_losses(dmuon_run, short_run_args, tmp_path):
    """``checkpoint.async_mode = "async"``: DCP stages the step-5 state and writes it while
    step 6 trains (the last step's checkpoint is written synchronously, as TorchTitan
    does). ``"async_with_pinned_mem"`` needs an accelerator (docs/torchtitan.md)."""
    full, _ = dmuon_run
    async_args = (*short_run_args, "--checkpoint.enable", "--checkpoint.interval", "5",
                  "--checkpoint.async_mode", "async")
    saved, _ = torchrun(DMUON_TOML, tmp_path / "saved", *async_args)
    run = tmp_path / "resumed"
    copy_checkpoint(tmp_path / "saved", 5, run)
    resumed, out = torchrun(DMUON_TOML, run, *async_args)
    assert "Loading the checkpoint" in out and "step-5" in out
    assert saved.train_loss == full.train_loss
    assert {s: resumed.train_loss[s] for s in range(6, 11)} == {s: full.train_loss[s] for s in range(6, 11)}


@pytest.fixture(scope="module")
def one_rank_resume(dmuon_run, short_run_args, tmp_path_factory):
    """The 2-rank step-5 checkpoint resumed on 1 rank for steps 6-7, dumping what it loaded.

    Returns (TitanLog, console text, the loaded state as ``state_dump`` wrote it).
    """
    _, full_folder = dmuon_run
    folder = tmp_path_factory.mktemp("one_rank_resume")
    copy_checkpoint(full_folder, 5, folder)
    dump = folder / "loaded_state.pt"
    log, out = torchrun(
        DMUON_TOML, folder, *short_run_args, "--training.steps", "7",
        "--checkpoint.enable", "--checkpoint.interval", "5",
        # The dataloader state is per data-parallel rank; TorchTitan cannot reshard it.
        "--checkpoint.exclude_from_loading", "dataloader",
        nproc=1, env={"TORCHTITAN_EXT_DUMP_LOADED_STATE": str(dump)},
    )
    return log, out, torch.load(dump, weights_only=False)


def test_a_checkpoint_written_by_two_ranks_loads_on_one_rank_and_trains_on(dmuon_run, one_rank_resume):
    full, _ = dmuon_run
    one_rank, out, _ = one_rank_resume
    assert "Loading the checkpoint" in out and "step-5" in out
    assert sorted(one_rank.train_loss) == [6, 7]
    # Trained weights were loaded: a fresh model starts near ln(2048) = 7.6.
    assert one_rank.train_loss[7] < full.train_loss[1] - 0.5, (one_rank.train_loss, full.train_loss)


def test_one_rank_loads_the_optimizer_state_two_ranks_saved_bit_for_bit(dmuon_run, one_rank_resume, tmp_path):
    _, full_folder = dmuon_run
    _, _, loaded = one_rank_resume
    saved = load_checkpoint(checkpoint_dir(full_folder, 5), tmp_path)
    # Momentum buffers and AdamW moments, every parameter: zeroed or mixed-up state fails.
    assert any(k.endswith("momentum_buffer") for k in saved["optimizer"])
    assert_same_tensors(loaded["optimizer"], saved["optimizer"])


def test_one_rank_loads_the_weights_two_ranks_saved_bit_for_bit(dmuon_run, one_rank_resume, tmp_path):
    _, full_folder = dmuon_run
    _, _, loaded = one_rank_resume
    saved = load_checkpoint(checkpoint_dir(full_folder, 5), tmp_path)
    # The checkpoint keeps the weights at its top level, beside the other states.
    saved_weights = {k: v for k, v in saved.items() if k not in NON_MODEL_STATES}
    assert_same_tensors(loaded["model"], saved_weights)


def test_pipeline_parallel_gives_each_stage_its_own_dmuon_and_trains(short_run_args, tmp_path):
    log, out = torchrun(
        DMUON_TOML, tmp_path, *short_run_args, "--training.steps", "8",
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.pipeline_parallel_schedule", "GPipe",
        log_rank=1,  # the last stage is the one that computes the loss
    )
    assert "DMuon (model part 0)" in out  # this rank's stage got its own DMuon
    assert log.train_loss[8] < log.train_loss[1], log.train_loss


def test_adamw_through_the_extension_trains_with_torchtitans_own_optimizer(short_run_args, tmp_path):
    log, out = torchrun(ADAMW_TOML, tmp_path, *short_run_args)
    assert "DMuon" not in out
    assert log.train_loss[10] < log.train_loss[1] - 0.5, log.train_loss


def _write_bad_toml(tmp_path: Path, old: str, new: str) -> Path:
    text = DMUON_TOML.read_text()
    assert old in text
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(old, new))
    return path


# One bad key is enough here: what this launch adds is that torchtitan.train parses (and
# so validates) before it builds the Trainer. Each key's message is specified in-process
# (tests/test_torchtitan_config.py: adjust_lr, adamw_param_regex, early_step_in_backward,
# ns_dtype, ns_coefficients, split_replicas), through the same ConfigManager.parse_args.
def test_a_bad_dmuon_setting_stops_torchrun_at_config_time_with_dmuons_message(tmp_path):
    bad = _write_bad_toml(tmp_path, 'adjust_lr = "original"', 'adjust_lr = "sqrt"')
    log, out = torchrun(bad, tmp_path / "dump", nproc=1, check=False)
    assert "[optimizer]: unknown adjust_lr 'sqrt'" in out
    assert not log.train_loss  # failed before any training step
    assert "Starting job" not in out  # ... before the Trainer was even created
