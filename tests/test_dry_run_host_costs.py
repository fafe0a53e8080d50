"""What a step costs the hosts, as the dry run reports it (``dmuon/dry_run/host_costs.py``):
collectives on CPU tensors, process groups DMuon makes (also under a default group that
takes no CPU tensors, as NCCL alone), the Python heap of the plan, and whether the steady
step dispatches the same program step after step. The program's comparison runs on meta
tensors (both CI legs); the dry runs need a CUDA build of torch (the torch 2.15 leg)."""

from __future__ import annotations

import pytest
import torch

from dmuon.dry_run.recorder import StepRecorder
from tests.dry_runs import dry_run, needs_cuda_build

pytestmark = pytest.mark.unit



def program_of(shape: tuple[int, ...], scale: float) -> list[tuple]:
    x = torch.empty(shape, device="meta")
    with StepRecorder() as recorder:
        x.mul_(scale).add_(1.0)
    return recorder.record.program


def test_two_steps_with_the_same_ops_and_shapes_have_the_same_program():
    assert program_of((4, 8), 0.5) == program_of((4, 8), 0.25) != []


def test_a_step_whose_shapes_change_has_another_program():
    assert program_of((4, 8), 0.5) != program_of((8, 8), 0.5)


@needs_cuda_build
def test_the_steady_step_repeats_its_program_and_its_plan_heap_is_measured():
    for report in dry_run("--model", "debug", "--world-size", "4", "--ranks", "0,3"):
        assert report.same_program and report.problems() == []
        assert report.plan_host_bytes > 0


@needs_cuda_build
@pytest.mark.parametrize("nccl_alone", [False, True], ids=["cpu-capable default group", "nccl alone"])
def test_host_collectives_and_groups_made_are_counted(nccl_alone):
    # Today: one host sum per step (the grad agreement); under NCCL alone it needs a gloo
    # group of its own, made once. (The step that scales past 1,000 ranks makes both 0.)
    flags = ("--nccl-alone",) if nccl_alone else ()
    for report in dry_run("--model", "debug", "--world-size", "4", "--ranks", "0,3", *flags):
        assert report.host_collectives_per_step == 1
        assert report.process_groups_made == (1 if nccl_alone else 0)
