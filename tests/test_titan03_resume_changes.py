"""Resuming a TorchTitan 0.3.x job with changed DMuon group options (issue 43, item 1):
``ns_steps`` and ``momentum`` changed on the command line are applied from the config on
resume (``dmuon.state.resume_contract``, through 0.3's flat FQN-keyed state and DCP), logged on
every rank, and change the losses after the first resumed step.

A 2-rank run of the 0.3.x CPU demo (10 steps, checkpoint at step 5) and one resume. Skipped
without TorchTitan 0.3 (the main suite runs on the 0.2.x stack); CI's newest-torch leg runs
it (``scripts/test_newest_torch.sh``, ``tests/test_titan03_*.py``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torchrun

from tests.titan03_support import require_titan03  # noqa: E402

require_titan03()

from tests import launch  # noqa: E402
from tests.checkpoints import checkpoint_dir  # noqa: E402
from torchtitan_ext.titan_log import parse_log, TitanLog  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG_MODULE = "torchtitan_ext.titan03.configs"
STEPS, CHECKPOINT_STEP = 10, 5
RUN_TIMEOUT_S = 300
GROUP_OPTION = "--optimizer.param_groups.0.optimizer_kwargs."


def torchrun03(dump_folder: Path, tokenizer_dir: Path, *overrides: str) -> tuple[TitanLog, list[str]]:
    """The 0.3 CPU demo on 2 ranks; rank 0's parsed log and every rank's text."""
    logs = dump_folder / "torchrun_logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--local-ranks-filter=0", "--log-dir", str(logs), "--redirects", "3", "--tee", "3",
           "-m", "torchtitan.train", "--module", CONFIG_MODULE, "--config", "llama3_debug_cpu",
           "--dump_folder", str(dump_folder), "--hf_assets_path", str(tokenizer_dir),
           "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--validator.no-enable",
           "--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_STEP), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = launch.run(cmd, timeout_s=RUN_TIMEOUT_S, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [(folder / "stdout.log").read_text() + (folder / "stderr.log").read_text()
             for folder in sorted(logs.glob("*/attempt_0/*"))]
    return parse_log(proc.stdout), ranks


def test_changed_group_options_are_applied_on_resume_and_logged_on_every_rank(tmp_path, tokenizer_dir):
    reference, _ = torchrun03(tmp_path / "reference", tokenizer_dir)
    run = tmp_path / "resumed"
    shutil.copytree(checkpoint_dir(tmp_path / "reference", CHECKPOINT_STEP), checkpoint_dir(run, CHECKPOINT_STEP))
    resumed, ranks = torchrun03(run, tokenizer_dir, f"{GROUP_OPTION}ns_steps", "1", f"{GROUP_OPTION}momentum", "0.5")
    assert len(ranks) == 2
    for text in ranks:
        assert "DMuon: changed on resume: ns_steps 5 -> 1 (group 0)" in text, text[-3000:]
        assert "DMuon: changed on resume: momentum 0.95 -> 0.5 (group 0)" in text, text[-3000:]
    assert sorted(resumed.train_loss) == list(range(CHECKPOINT_STEP + 1, STEPS + 1))
    first = CHECKPOINT_STEP + 1  # its loss is taken before its update: the same
    assert resumed.train_loss[first] == reference.train_loss[first]
    assert all(resumed.train_loss[s] != reference.train_loss[s] for s in range(first + 1, STEPS + 1))
