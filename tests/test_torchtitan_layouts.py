"""End-to-end: DMuon under TorchTitan's other parameter layouts, on CPU ranks.

Each test trains a few steps (5) under one parallelism layout TorchTitan 0.2.2
builds -- HSDP, FSDP x TP, TP, and expert parallelism in the two MoE models --
and checks that the loss went down. ``scripts/show_layouts.py`` prints each
parameter's mesh and placements under these layouts. PP has its test in
``test_torchtitan_e2e.py``. One EP run also checkpoints, and a second run resumes
from that checkpoint and ends with the same checkpoint, bit for bit.

DMuon logs, at its first step, which communication path each Muon parameter
takes (``comm_paths`` reads those lines back). Every Muon parameter of these layouts
takes a fast path (``local`` or ``all_to_all``), never the ``redistribute``
reference path (an all-gather of the whole matrix on every rank).
"""

from __future__ import annotations

import re

import pytest

from tests.checkpoints import assert_same_checkpoints, checkpoint_dir
from tests.titan_runs import copy_checkpoint, DMUON_TOML, torchrun

pytestmark = pytest.mark.torchrun

STEPS = 5
# Four or five ranks' worth of work on two cores: every run is kept to a few steps.
FEW_STEPS = ["--training.steps", str(STEPS)]
HSDP_2x2 = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
FSDP_2_TP_2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
TP_2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]
# On 2 ranks EP 2 takes both ranks of the FSDP dimension: experts on the ("efsdp", "ep")
# mesh of shape (1, 2), everything else FSDP on ("fsdp",) of shape (2,).
EP_2 = ["--parallelism.expert_parallel_degree", "2"]

_PATH_LINE = re.compile(r"DMuon: (?P<count>\d+) Muon parameter\(s\) use the (?P<path>\w+) path: (?P<names>.*)$")


def comm_paths(console: str) -> dict[str, list[str]]:
    """{path: [parameter names]} from the ``DMuon: N Muon parameter(s) use the <path> path: ...`` lines.

    ``console`` is one rank's output (rank 0 in these tests). Each DMuon logs one
    line per path at its first step; with several model parts the lists are joined.
    """
    paths: dict[str, list[str]] = {}
    for line in console.splitlines():
        if m := _PATH_LINE.search(line.rstrip()):
            names = m["names"].split(", ")
            assert len(names) == int(m["count"]), line  # the count DMuon printed matches its list
            paths.setdefault(m["path"], []).extend(names)
    return paths


def moe_model(name: str) -> list[str]:
    # Both debug flavors have vocab 2048, the size of the embedded tokenizer.
    return ["--model.name", name, "--model.flavor", "debugmodel"]


def assert_trained(log) -> None:
    assert sorted(log.train_loss) == list(range(1, STEPS + 1)), log.train_loss
    assert log.train_loss[STEPS] < log.train_loss[1], log.train_loss


def all_names(paths: dict[str, list[str]]) -> list[str]:
    return [name for names in paths.values() for name in names]


# (flags, ranks, a Muon weight the run must log a path for). HSDP: ("dp_replicate", "fsdp")
# with (Replicate(), Shard(0)); FSDP x TP: ("fsdp", "tp") with (_StridedShard(0), Shard(0)) /
# (Shard(0), Shard(1)); TP: a 1-D ("tp",) mesh with Shard(0) / Shard(1) (wo is rowwise).
DENSE_LAYOUTS = {
    "hsdp_2x2": (HSDP_2x2, 4, "layers.0.attention.wq.weight"),
    "fsdp_2_x_tp_2": (FSDP_2_TP_2, 4, "layers.0.attention.wo.weight"),
    "tp_2": (TP_2, 2, "layers.0.attention.wo.weight"),
}


@pytest.mark.parametrize("layout", list(DENSE_LAYOUTS))
def test_a_dense_layout_trains_with_dmuon_on_the_owner_exchange(short_run_args, tmp_path, layout):
    flags, nproc, weight = DENSE_LAYOUTS[layout]
    log, out = torchrun(DMUON_TOML, tmp_path, *short_run_args, *FEW_STEPS, *flags, nproc=nproc)
    assert_trained(log)
    paths = comm_paths(out)
    assert weight in all_names(paths)
    assert "redistribute" not in paths, paths


@pytest.mark.extended
def test_deepseek_v3_with_expert_parallel_2_trains_with_dmuon(short_run_args, tmp_path):
    log, out = torchrun(DMUON_TOML, tmp_path, *short_run_args, *FEW_STEPS, *moe_model("deepseek_v3"), *EP_2)
    assert_trained(log)
    paths = comm_paths(out)
    assert "layers.1.moe.experts.w1" in all_names(paths)  # the [E, out, in] stacks are Muon matrices
    # the expert stacks sit on ("efsdp", "ep") with (_StridedShard(0), Shard(0)).
    assert "redistribute" not in paths, paths


CHECKPOINT_STEP = 3


@pytest.fixture(scope="module")
def llama4_ep_run(short_run_args, tmp_path_factory):
    """llama4 debug model, EP 2 on 2 ranks, checkpointing at step 3: (TitanLog, console, dump folder)."""
    folder = tmp_path_factory.mktemp("llama4_ep2")
    log, out = torchrun(DMUON_TOML, folder, *short_run_args, *FEW_STEPS, *moe_model("llama4"), *EP_2,
                        "--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_STEP))
    return log, out, folder


def test_llama4_with_expert_parallel_2_trains_with_dmuon(llama4_ep_run):
    log, out, _ = llama4_ep_run
    assert_trained(log)
    paths = comm_paths(out)
    assert "layers.1.moe.experts.w1" in all_names(paths)
    # the expert stacks sit on ("efsdp", "ep") with (_StridedShard(0), Shard(0)).
    assert "redistribute" not in paths, paths


def test_resuming_an_expert_parallel_run_reproduces_the_uninterrupted_run_bit_for_bit(llama4_ep_run, short_run_args,
                                                                                     tmp_path):
    full, _, full_folder = llama4_ep_run
    run = tmp_path / "resumed"
    copy_checkpoint(full_folder, CHECKPOINT_STEP, run)
    resumed, out = torchrun(DMUON_TOML, run, *short_run_args, *FEW_STEPS, *moe_model("llama4"), *EP_2,
                            "--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_STEP))
    assert "Loading the checkpoint" in out and f"step-{CHECKPOINT_STEP}" in out
    later = range(CHECKPOINT_STEP + 1, STEPS + 1)
    assert sorted(resumed.train_loss) == list(later)
    assert {s: resumed.train_loss[s] for s in later} == {s: full.train_loss[s] for s in later}
    # The losses are printed with 5 decimals; the last checkpoints hold every bit: the
    # momentum of the expert stacks, the AdamW moments and the MoE expert_bias buffer.
    assert_same_checkpoints(checkpoint_dir(run, STEPS), checkpoint_dir(full_folder, STEPS), tmp_path / "loaded")
