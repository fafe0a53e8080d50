"""scripts/demo_summary.py: the summary scripts/demo.sh ends with, read from a run's console log."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("demo_summary", REPO / "scripts" / "demo_summary.py")
demo_summary = importlib.util.module_from_spec(_spec)
sys.modules["demo_summary"] = demo_summary
_spec.loader.exec_module(demo_summary)

# Rank 0's console as demo.sh tees it (torchrun --tee adds "[default0]:"): ten lines of the
# 200-step demo run of 2026-12-06 (step lines at 1 and every 10th, validation at 1 and every
# 20th), DMuon's figures cut from the step lines after step 1.
SAMPLE = """\
[default0]:[titan] 2026-12-06 18:05:14,065 - root - INFO - Starting job: llama3 debug model, DMuon (CPU demo)
[default0]:[titan] 2026-12-06 18:05:16,219 - root - INFO - Training starts at step 1
[default0]:[titan] 2026-12-06 18:05:17,973 - root - INFO - step:  1  loss:  8.18072  grad_norm:  0.7111  memory:  0.71GiB(3.00%)  tps: 220  tflops: 0.01  mfu: 0.00%  opt: 253.6ms  ns: 133.3ms  sent: 4.88MiB  muon_rms upd/w: 4.98e-05/1.51e-02  adamw_rms upd/w: 7.80e-05/7.11e-01
[default0]:[titan] 2026-12-06 18:05:19,128 - root - INFO - validate step:  1  loss:  8.1337  memory:  0.74GiB(3.14%)  tps: 1,773
[default0]:[titan] 2026-12-06 18:05:32,156 - root - INFO - step: 10  loss:  7.92405  grad_norm:  0.7688  memory:  0.78GiB(3.30%)  tps: 354  tflops: 0.01  mfu: 0.00%
[default0]:[titan] 2026-12-06 18:09:50,187 - root - INFO - step: 190  loss:  5.28145  grad_norm:  0.8689  memory:  0.87GiB(3.71%)  tps: 309  tflops: 0.01  mfu: 0.00%
[default0]:[titan] 2026-12-06 18:10:05,282 - root - INFO - step: 200  loss:  4.97508  grad_norm:  0.9208  memory:  0.88GiB(3.75%)  tps: 339  tflops: 0.01  mfu: 0.00%
[default0]:[titan] 2026-12-06 18:10:06,656 - root - INFO - validate step: 200  loss:  5.1295  memory:  0.89GiB(3.80%)  tps: 1,492
[default0]:[titan] 2026-12-06 18:10:06,657 - root - INFO - Sleeping 2 seconds for other ranks to complete
[default0]:[titan] 2026-12-06 18:10:08,657 - root - INFO - Training completed
"""
LOG = "outputs/demo/dmuon.log"


def test_the_summary_gives_steps_losses_and_where_the_files_are():
    text = demo_summary.summarise({"dmuon": (SAMPLE, LOG)}, steps=200,
                                  ranks_dirs={"dmuon": "outputs/demo/dmuon_ranks/"})
    assert text.splitlines() == [
        "== summary",
        "dmuon: 200 steps, completed",
        "  train loss       8.1807 at step 1 -> 4.9751 at step 200",
        "  validation loss  8.1337 at step 1 -> 5.1295 at step 200",
        "  log              outputs/demo/dmuon.log (rank 0; every rank's: outputs/demo/dmuon_ranks/)",
        "checkpoints: none written ([checkpoint] enable = false in the TOML)",
        "loss plot: none from this run; bash scripts/demo.sh --compare writes outputs/demo/loss_dmuon_vs_adamw.png",
    ]


def test_an_unfinished_run_reports_its_last_step_line_not_the_steps_asked_for():
    unfinished = SAMPLE.split("[default0]:[titan] 2026-12-06 18:09:50")[0]  # stops after step 10
    text = demo_summary.summarise({"dmuon": (unfinished, LOG)}, steps=200)
    assert "dmuon: 10 steps by its last step line" in text
    assert "  train loss       8.1807 at step 1 -> 7.9241 at step 10" in text
    assert "  validation loss  8.1337 at step 1 -> 8.1337 at step 1" in text


def test_checkpoints_plot_and_no_validation_come_from_the_run():
    announced = ("[titan] 2026-12-06 18:05:17,000 - root - INFO - Checkpointing active. Checkpoints will be "
                 "loaded from and saved to ./outputs/llama3_debug_dmuon/checkpoint\n")
    no_validation = "\n".join(line for line in SAMPLE.splitlines() if "validate" not in line)
    text = demo_summary.summarise(
        {"dmuon": (announced + no_validation, LOG), "adamw": (SAMPLE, "outputs/demo/adamw.log")},
        steps=200, plot="outputs/demo/loss_dmuon_vs_adamw.png")
    assert "  validation loss  none (validation off)" in text
    assert "checkpoints of dmuon: ./outputs/llama3_debug_dmuon/checkpoint" in text
    assert "checkpoints: none" not in text
    assert "adamw: 200 steps, completed" in text
    assert text.endswith("loss plot: outputs/demo/loss_dmuon_vs_adamw.png (numbers: outputs/demo/summary.txt)")


def test_a_log_without_step_lines_says_so():
    text = demo_summary.summarise({"dmuon": ("Traceback (most recent call last):\n", LOG)})
    assert "dmuon: no step lines in outputs/demo/dmuon.log; did the run fail?" in text


def test_the_command_line_reads_the_toml_and_checks_the_paths(tmp_path):
    log = tmp_path / "dmuon.log"
    log.write_text(SAMPLE)
    (tmp_path / "dmuon_ranks").mkdir()
    toml = tmp_path / "run.toml"
    toml.write_text("[training]\nsteps = 200\n")
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo_summary.py"), "--run", f"dmuon={log}", "--toml", str(toml),
         "--plot", str(tmp_path / "absent.png")],
        check=True, capture_output=True, text=True).stdout
    assert "dmuon: 200 steps, completed" in out
    assert f"every rank's: {tmp_path / 'dmuon_ranks'}/" in out
    assert "loss plot: none from this run" in out  # the plot named does not exist
