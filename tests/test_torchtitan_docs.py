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


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """One run of the example on 2 CPU ranks (rank 0's output), with Python's default
    warning filter so that a UserWarning is printed whatever the environment sets."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--local-ranks-filter=0", str(EXAMPLE)]
    return launch.run(cmd, timeout_s=180, cwd=tmp_path_factory.mktemp("example"), env=env)


def test_the_fsdp2_example_in_the_docs_trains_on_two_cpu_ranks(example_run):
    out = example_run.stdout
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2, out[-2000:]
    # A plain gloo program can abort at interpreter exit after finishing its work: a gloo
    # worker thread frees a tensor during finalization (pytorch/pytorch#190489;
    # docs/reliability.md). TorchTitan runs are protected by cpu_compat; this example is user
    # code and stays as a user would write it, so that one upstream abort is tolerated.
    assert example_run.returncode == 0 or _only_the_upstream_exit_abort(out), out[-4000:]


def test_the_fsdp2_examples_wrapped_blocks_return_no_view_so_fsdp2_does_not_warn(example_run):
    # FSDP2 warns when a module it wraps returns a view (an in-place op on it would skip
    # the all-gather); the example's blocks add their residual inside, out of place.
    assert "returned a view tensor" not in example_run.stdout, example_run.stdout[-4000:]


def _only_the_upstream_exit_abort(out: str) -> bool:
    """All steps ran, and torchrun's failure report holds only a SIGABRT (exit code -6)
    and the SIGTERM (-15) it then sent the other ranks: no Python error (exit code 1)."""
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", out))
    return "step 30: loss" in out and "-6" in codes and codes <= {"-6", "-15"}
