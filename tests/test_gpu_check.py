"""scripts/gpu_check.sh's own logic that needs no GPU: its summary (``benchmarks.gpu_check_summary``)
reads the parts' statuses, JUnit reports, fragments and TorchTitan's losses, and a part
whose loss does not fall is failed; the script refuses bad use before doing anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check_summary import summarize

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
JUNIT = """<testsuites><testsuite>
<testcase name="a"/><testcase name="b"><skipped message="needs 2 or more GPUs"/></testcase>
<testcase name="c"><failure message="boom"/></testcase>
</testsuite></testsuites>"""


def _work(tmp_path: Path, losses: tuple[float, float]) -> tuple[Path, Path]:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out.mkdir()
    (work / "setup.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"}))
    (work / "parts.tsv").write_text("cuda_tests\tfailed\t12\ttests.log\texit status 1\n"
                                    "compare\tok\t9\tthroughput.log\t\n"
                                    "torchtitan\tok\t30\ttorchtitan.log\t\n"
                                    "two_ranks\tskipped\t0\ttwo_ranks.log\tneeds a CUDA GPU\n")
    (work / "cuda_tests.xml").write_text(JUNIT)
    (work / "compare.json").write_text(json.dumps({"status": "ok", "figures": {"dmuon_step_ms": 1.5}, "reason": ""}))
    (out / "torchtitan.log").write_text(f"step:  1  loss:  {losses[0]}  grad_norm: 1\nstep:  2  loss:  {losses[1]}\n")
    return work, out


def test_the_summary_holds_every_parts_status_figures_and_the_device(tmp_path):
    work, out = _work(tmp_path, (8.1, 7.9))
    summary = summarize(work, out)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["device"] == "NVIDIA H100 80GB HBM3" and (summary["ok"], summary["failed"], summary["skipped"]) == (2, 1, 1)
    parts = summary["parts"]
    assert {k: parts["cuda_tests"]["figures"]["tests"][k] for k in ("passed", "failed", "skipped")} == \
        {"passed": 1, "failed": 1, "skipped": 1}
    assert parts["compare"]["figures"] == {"dmuon_step_ms": 1.5}
    assert parts["torchtitan"]["figures"]["loss_falls"] and parts["torchtitan"]["status"] == "ok"
    assert parts["two_ranks"]["reason"] == "needs a CUDA GPU"


def test_a_torchtitan_run_whose_loss_does_not_fall_is_failed(tmp_path):
    work, out = _work(tmp_path, (7.9, 8.1))
    part = summarize(work, out)["parts"]["torchtitan"]
    assert part["status"] == "failed" and "no falling loss" in part["reason"]


@pytest.mark.parametrize("args", [[], ["a", "b"], ["--rehearse"]])
def test_the_gpu_check_refuses_bad_use_before_anything(args):
    out = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert out.returncode == 2 and "usage: bash scripts/gpu_check.sh [--rehearse] OUT" in out.stderr
