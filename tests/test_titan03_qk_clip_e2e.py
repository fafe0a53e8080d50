"""QK-clip through a real TorchTitan 0.3 job: ``llama3_debug_cpu_qk_clip`` (the CPU demo
with ``qk_clip_threshold``) on 2 gloo ranks with FSDP2, a threshold low enough that heads
are clipped from the first step, a few steps. One run; skipped without TorchTitan 0.3.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torchrun

from tests.titan03_support import require_titan03  # noqa: E402

require_titan03()

from tests import launch  # noqa: E402
from torchtitan_ext.titan_log import parse_log  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
# The debug model's largest logit starts near 0.75 on this corpus (0.7..0.86 over the
# first 8 steps without clipping): 0.5 clips from the first step.
LOW_THRESHOLD = 0.5
RUN_TIMEOUT_S = 300
MIN_LOSS_DROP = 0.2
QK_CLIP_TEXT = re.compile(r"max_logit: (?P<max_logit>[-+0-9.eEnaif]+)\s+clipped_heads: (?P<clipped>\d+)")


def test_a_qk_clip_run_logs_clipped_heads_and_trains(tmp_path, tokenizer_dir):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--local-ranks-filter=0", "-m", "torchtitan.train",
        "--module", "torchtitan_ext.titan03.configs", "--config", "llama3_debug_cpu_qk_clip",
        "--dump_folder", str(tmp_path), "--hf_assets_path", str(tokenizer_dir),
        "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
        "--validator.no-enable",
        "--optimizer.param_groups.0.optimizer_kwargs.qk_clip_threshold", str(LOW_THRESHOLD),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = launch.run(cmd, timeout_s=RUN_TIMEOUT_S, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]

    log = parse_log(proc.stdout)
    assert sorted(log.train_loss) == list(range(1, STEPS + 1))
    losses = [log.train_loss[s] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(loss) for loss in losses)
    step_lines = [line for line in proc.stdout.splitlines() if "step:" in line and "loss:" in line
                  and "validate" not in line]
    print("\n".join(step_lines))  # shown with pytest -s
    # Few steps in warmup: the loss falls, if less than without clipping at so low a threshold.
    assert losses[-1] < losses[0] - MIN_LOSS_DROP, f"loss fell only from {losses[0]:.3f} to {losses[-1]:.3f}"

    clip = [QK_CLIP_TEXT.search(line) for line in step_lines]
    assert len(step_lines) == STEPS and all(clip), "a step line without QK-clip's figures"
    # Every step measured logits; the first already exceeded the threshold in some of the
    # 6 x 16 heads and clipped them.
    assert all(math.isfinite(float(m["max_logit"])) and 0 <= int(m["clipped"]) <= 96 for m in clip)
    assert float(clip[0]["max_logit"]) > LOW_THRESHOLD and int(clip[0]["clipped"]) > 0
