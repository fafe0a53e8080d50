"""End-to-end: real ``torchrun`` TorchTitan runs of the llama3 debug model on CPU ranks.

Each test launches ``torchrun --standalone`` (a free port is picked) with
``OMP_NUM_THREADS=1``, a timeout, and its own process group, which is killed
whole if the run hangs. Runs are short (<= 10 steps at seq_len 128); one 2-rank
run with checkpoints is shared by three tests through a module fixture.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ext.titan_log import parse_log, TitanLog
from torchtitan_ext.tokenizer import ensure_tokenizer

REPO = Path(__file__).resolve().parents[1]
DMUON_TOML = REPO / "train_configs" / "llama3_debug_dmuon.toml"
ADAMW_TOML = REPO / "train_configs" / "llama3_debug_adamw.toml"
RUN_TIMEOUT_S = 300


class RunFailed(AssertionError):
    pass


def torchrun(toml: Path, dump_folder: Path, *overrides: str, nproc: int = 2, check: bool = True,
             log_rank: int = 0):
    """Run TorchTitan; return (TitanLog of rank ``log_rank``, its console text)."""
    rank_logs = dump_folder / "torchrun_logs"  # every rank's output, shown if the run fails
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--local-ranks-filter={log_rank}",
        "--log-dir", str(rank_logs), "--redirects", "3", "--tee", "3",
        "-m", "torchtitan.train",
        "--job.config_file", str(toml),
        "--job.dump_folder", str(dump_folder),
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    # A new session makes the run a process group we can kill as a whole.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise RunFailed(f"torchrun timed out after {RUN_TIMEOUT_S}s:\n{out[-4000:]}{_tails(rank_logs)}")
    if check and proc.returncode != 0:
        raise RunFailed(f"torchrun exited with {proc.returncode}:\n{out[-6000:]}{_tails(rank_logs)}")
    return parse_log(out), out


def _tails(rank_logs: Path) -> str:
    """The end of every rank's stderr (the console only shows one rank)."""
    parts = [f"\n--- {f} ---\n{f.read_text()[-2000:]}" for f in sorted(rank_logs.rglob("stderr.log"))]
    return "".join(parts)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def short_run_args(tokenizer_dir) -> list[str]:
    """Overrides that make the demo config a ~10-step test."""
    return [
        "--model.hf_assets_path", str(tokenizer_dir),
        "--training.seq_len", "128",
        "--training.steps", "10",
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--validation.no-enable",
    ]


@pytest.fixture(scope="module")
def dmuon_run(tmp_path_factory, short_run_args) -> tuple[TitanLog, Path]:
    """10 DMuon steps on 2 ranks, checkpointing at steps 5 and 10."""
    folder = tmp_path_factory.mktemp("dmuon_run")
    log, _ = torchrun(DMUON_TOML, folder, *short_run_args,
                      "--checkpoint.enable", "--checkpoint.interval", "5")
    return log, folder


def copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    shutil.copytree(src_run / "checkpoint" / f"step-{step}", dst_run / "checkpoint" / f"step-{step}")


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


def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_losses(dmuon_run, short_run_args, tmp_path):
    full, full_folder = dmuon_run
    copy_checkpoint(full_folder, 5, tmp_path)
    resumed, out = torchrun(DMUON_TOML, tmp_path, *short_run_args,
                            "--checkpoint.enable", "--checkpoint.interval", "5")
    assert "Loading the checkpoint" in out and "step-5" in out
    assert sorted(resumed.train_loss) == [6, 7, 8, 9, 10]
    # Printed with 5 decimals: equal strings mean equal to ~1e-5, i.e. bitwise in practice.
    assert {s: resumed.train_loss[s] for s in range(6, 11)} == {s: full.train_loss[s] for s in range(6, 11)}


def test_a_checkpoint_written_by_two_ranks_loads_on_one_rank_and_trains_on(dmuon_run, short_run_args, tmp_path):
    full, full_folder = dmuon_run
    copy_checkpoint(full_folder, 5, tmp_path)
    one_rank, out = torchrun(
        DMUON_TOML, tmp_path, *short_run_args, "--training.steps", "7",
        "--checkpoint.enable", "--checkpoint.interval", "5",
        # The dataloader state is per data-parallel rank; TorchTitan cannot reshard it.
        "--checkpoint.exclude_from_loading", "dataloader",
        nproc=1,
    )
    assert "Loading the checkpoint" in out and "step-5" in out
    assert sorted(one_rank.train_loss) == [6, 7]
    # Trained weights were loaded: a fresh model starts near ln(2048) = 7.6.
    assert one_rank.train_loss[7] < full.train_loss[1] - 0.5, (one_rank.train_loss, full.train_loss)


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


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('adjust_lr = "original"', 'adjust_lr = "sqrt"', "[optimizer] adjust_lr = 'sqrt' is not known"),
        ("adamw_param_regex = '", "adamw_param_regex = '[unclosed", "[optimizer] adamw_param_regex = '[unclosed"),
        ('name = "DMuon"', 'name = "DMuon"\nearly_step_in_backward = true',
         "[optimizer] early_step_in_backward = true is not supported"),
    ],
    ids=["unknown_adjust_lr", "bad_regex", "early_step_in_backward"],
)
def test_a_bad_dmuon_setting_stops_torchrun_at_config_time_naming_the_toml_key(tmp_path, old, new, message):
    bad = _write_bad_toml(tmp_path, old, new)
    log, out = torchrun(bad, tmp_path / "dump", nproc=1, check=False)
    assert message in out
    assert not log.train_loss  # failed before any training step
    assert "Starting job" not in out  # ... before the Trainer was even created
