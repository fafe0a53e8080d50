"""The FSDP2 example the README shows (examples/fsdp2_dmuon.py) runs as written, on 2 CPU ranks."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests import launch

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "fsdp2_dmuon.py"


def test_the_fsdp2_example_in_the_docs_trains_on_two_cpu_ranks(tmp_path):
    script = EXAMPLE
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--local-ranks-filter=0", str(script)]
    proc = launch.run(cmd, timeout_s=180, cwd=tmp_path, env=env)
    out = proc.stdout
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2, out[-2000:]
    # A plain gloo program can abort at interpreter exit after finishing its work: a gloo
    # worker thread frees a tensor during finalization (pytorch/pytorch#190489;
    # docs/reliability.md). TorchTitan runs are protected by cpu_compat; this example is user
    # code and stays as a user would write it, so that one upstream abort is tolerated.
    assert proc.returncode == 0 or _only_the_upstream_exit_abort(out), out[-4000:]


def _only_the_upstream_exit_abort(out: str) -> bool:
    """All steps ran, and torchrun's failure report holds only a SIGABRT (exit code -6)
    and the SIGTERM (-15) it then sent the other ranks: no Python error (exit code 1)."""
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", out))
    return "step 30: loss" in out and "-6" in codes and codes <= {"-6", "-15"}
