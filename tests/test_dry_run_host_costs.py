"""What a step costs the hosts, as the dry run reports it (``dmuon/tools/dry_run/host_costs.py``):
collectives on CPU tensors, process groups DMuon makes (also under a default group that
takes no CPU tensors, as NCCL alone), the Python heap of the plan, and whether the steady
step dispatches the same program step after step. The program's comparison runs on meta
tensors (both CI legs); the dry runs need a CUDA build of torch (the torch 2.15 leg)."""

from __future__ import annotations

import pytest
import torch

from dmuon.tools.dry_run.recorder import StepRecorder
from tests.dry_runs import dry_run, dry_run_sweep, needs_cuda_build, sweep

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


def recorded(shape: tuple[int, ...], scale: float):
    x = torch.empty(shape, device="meta")
    with StepRecorder() as recorder:
        x.mul_(scale).add_(torch.tensor(scale * 2))  # a number, and a 0-dim CPU tensor's value
    return recorder.record


def test_steps_that_launch_the_same_ops_with_other_numbers_are_told_apart_by_their_scalars():
    from dmuon.tools.dry_run.recorder import first_scalar_changes

    steps = [recorded((4, 8), scale) for scale in (0.5, 0.25, 0.125)]
    changes = first_scalar_changes([s.program for s in steps], [s.scalars for s in steps])
    assert [c.split(":")[0] for c in changes] == ["aten.mul_.Tensor", "aten.add_.Tensor"]
    assert "(0.5,) -> (0.25,) -> (0.125,)" in changes[0] and "(1.0," in changes[1]


def test_steps_with_the_same_numbers_show_no_scalar_change():
    from dmuon.tools.dry_run.recorder import first_scalar_changes

    steps = [recorded((4, 8), 0.5) for _ in range(3)]
    assert first_scalar_changes([s.program for s in steps], [s.scalars for s in steps]) == []


@needs_cuda_build
@dry_run_sweep
def test_the_steady_step_repeats_its_program_and_its_plan_heap_is_measured():
    for report in dry_run("--model", "debug", "--world-size", "4", "--ranks", "0,3"):
        assert report.same_program and report.problems() == []
        assert report.plan_host_bytes > 0
        # Under a changing learning rate and weight decay, the step without capturable bakes
        # them into its launches (issue 42): reported, with the ops where they moved, not failed.
        assert not report.same_scalars and report.scalar_changes


@needs_cuda_build
@pytest.mark.parametrize("layout, world, extra", [
    sweep("fsdp", 4, (), first_of_rule=True), sweep("hsdp:2x2", 4, ()), sweep("fsdp_tp:2", 4, ()),
    sweep("fsdp", 4, ("--param-dtype", "bfloat16")),
    sweep("fsdp", 4, ("--normuon", "--cautious-weight-decay", "--skip-nonfinite")),
])
def test_a_capturable_step_launches_the_same_program_with_the_same_host_values_every_step(layout, world, extra):
    for report in dry_run("--model", "debug", "--world-size", str(world), "--layout", layout, "--ranks",
                          f"0,{world - 1}", "--capturable", *extra):
        assert report.problems() == [] and report.host_syncs_per_step == 0
        assert report.same_program and report.same_scalars and report.scalar_changes == []


@needs_cuda_build
def test_a_plain_adamw_parameter_takes_the_list_path_a_real_tensor_would():
    # Under TP alone the debug model's norms stay plain tensors: fake ones in the dry run,
    # which torch.optim's list-path rule must take as the torch.Tensor they stand for
    # (dmuon.torch_compat.fake_tensors_take_the_list_path); else the AdamW part steps tensor by
    # tensor, and the capturable AdamW's list ops (torch's div_ among them) never show.
    (report,) = dry_run("--model", "debug", "--world-size", "2", "--layout", "tp", "--ranks", "0", "--capturable")
    assert report.per_tensor_list_ops.get("aten._foreach_div_.List") == 2, report.per_tensor_list_ops


@needs_cuda_build
def test_experts_under_ep_step_capturable_with_the_same_host_values():
    for report in dry_run("--model", "moe-debug", "--world-size", "4", "--layout", "ep", "--ranks", "0,3",
                          "--capturable"):
        assert report.problems() == [] and report.same_scalars


def test_capturable_requires_the_same_scalars_and_says_which_ops_moved():
    report = passing_report()
    report.capturable, report.same_scalars, report.scalar_changes = True, False, ["aten.add_.Tensor: 1 -> 2 -> 3"]
    assert report.problems() == ["capturable, but steps 2 to 4 launched different host values: "
                                 "['aten.add_.Tensor: 1 -> 2 -> 3']"]
    report.capturable = False
    assert report.problems() == []


@needs_cuda_build
@pytest.mark.parametrize("nccl_alone", [sweep(False, first_of_rule=True), sweep(True)],
                         ids=["cpu-capable default group", "nccl alone"])
def test_the_step_runs_no_host_collective_and_makes_no_group(nccl_alone):
    flags = ("--nccl-alone",) if nccl_alone else ()
    for report in dry_run("--model", "debug", "--world-size", "4", "--ranks", "0,3", *flags):
        assert (report.host_collectives_per_step, report.process_groups_made) == (0, 0)
        assert report.problems() == []


def passing_report():
    from dmuon.tools.dry_run.run import RankReport

    return RankReport(rank=0, host_syncs_per_step=0, host_sync_sites=[], bytes_sent_per_rank=0,
                      plan_bytes_sent_per_rank=0, collectives=[], device_ops_per_step=0, state_bytes=0,
                      peak_step_bytes=0, peak_bound_bytes=1, mixed_device_ops=[], precision_hazards=[],
                      state_layout_problems=[], muon_params=0, adamw_params=0, seconds=0.0)


@pytest.mark.parametrize("field, value, problem", [
    ("host_collectives_per_step", 1, "collective(s) on CPU tensors"),
    ("process_groups_made", 1, "process group(s) made by DMuon"),
    ("plan_host_bytes", 1 << 40, "bytes of Python heap, over its bound"),
    ("same_program", False, "program"),
])
def test_what_a_fake_group_hides_fails_the_dry_run(field, value, problem):
    import dataclasses

    assert passing_report().problems() == []
    problems = dataclasses.replace(passing_report(), **{field: value}).problems()
    assert any(problem in p for p in problems), problems
