"""``python -m dmuon.tools.dry_run --cpu-offload``: FSDP2's ``CPUOffloadPolicy`` on fake CUDA.

Parameters, grads and DMuon's state are host tensors on the CUDA mesh; the step must send
the plan's bytes, mix devices only in its copies, keep the state on the host, and wait
for the device exactly where docs/dry_run.md ("CPU offload") says: the waits
``dmuon.exchange.host_staging`` announces, counted by the recorder, against
``dmuon.tools.dry_run.offload.documented_waits``. Needs a CUDA build of torch (CI's torch 2.15 leg).
"""

from __future__ import annotations

import pytest

from dmuon.tools.dry_run.__main__ import main
from dmuon.exchange.host_staging import ADAMW_MASK, MASKS, NORMUON_ROWS, QK_CLIP_FACTORS, RESULTS
from tests.dry_runs import dry_run, dry_run_sweep, needs_cuda_build, sweep

pytestmark = pytest.mark.unit


def assert_offloaded_and_clean(reports) -> None:
    for report in reports:
        assert report.problems() == [], (report.rank, report.problems())
        assert report.host_syncs_per_step == report.host_syncs_first_step == 0
        assert report.bytes_sent_per_rank == report.plan_bytes_sent_per_rank > 0
        assert report.state_bytes == 0 and report.state_layout_problems == []  # the state is on the host
        assert report.offload_waits == report.documented_offload_waits
        assert report.offload_waits[MASKS] == 1 and report.offload_waits[RESULTS] > 0


@needs_cuda_build
@pytest.mark.parametrize("layout, world_size", [sweep("fsdp", 4, first_of_rule=True), sweep("hsdp:2x2", 4),
                                               sweep("fsdp_tp:2", 4)])
def test_an_offloaded_layout_steps_with_the_planned_bytes_and_only_the_documented_waits(layout, world_size):
    assert_offloaded_and_clean(dry_run("--model", "debug", "--world-size", str(world_size), "--layout", layout,
                                       "--ranks", f"0,{world_size - 1}", "--cpu-offload"))


@needs_cuda_build
@dry_run_sweep
def test_offloaded_normuon_and_qk_clip_wait_once_more_each():
    reports = dry_run("--model", "debug", "--world-size", "4", "--layout", "fsdp", "--ranks", "0,3", "--normuon",
                      "--cautious-weight-decay", "--qk-clip", "30", "--cpu-offload")
    assert_offloaded_and_clean(reports)
    assert [(r.offload_waits[NORMUON_ROWS], r.offload_waits[QK_CLIP_FACTORS]) for r in reports] == [(1, 1)] * 2


@needs_cuda_build
@dry_run_sweep
def test_offloaded_llama3_8b_on_64_ranks_sends_the_bytes_it_sends_without_offload():
    (report,) = dry_run("--model", "llama3-8b", "--world-size", "64", "--layout", "fsdp", "--ranks", "63",
                        "--cpu-offload")
    assert_offloaded_and_clean([report])
    assert report.bytes_sent_per_rank == 413138944  # test_dry_run.py's figure without offload
    assert report.offload_waits == {MASKS: 1, RESULTS: 2, ADAMW_MASK: 1}  # two batches; the AdamW part on the host


def test_cpu_offload_on_a_layout_without_fsdp2_gets_a_one_line_error_and_exit_code_2(capsys):
    assert main(["--model", "debug", "--world-size", "4", "--layout", "tp", "--cpu-offload"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-offload is FSDP2's offload policy" in err and err.count("\n") == 1
