"""End-to-end under TorchTitan 0.3.x: DMuon under TorchTitan's other parameter
layouts, on CPU ranks (gloo), 5 steps each.

Each test trains the CPU demo (``torchtitan_ext.titan03.configs.llama3_debug_cpu``;
qwen3's MoE debug model for expert parallelism) under one layout TorchTitan 0.3 builds
with its default ``parallelism.spmd_backend`` ("spmd_types") -- HSDP, FSDP x TP, TP,
EP -- and checks that the loss went down and that every Muon matrix took the owner
exchange (``all_to_all``), read from the path lines DMuon logs at its first step
(``tests/test_torchtitan_layouts.py`` does the same under 0.2.x).
``test_tp_2_trains_the_same_under_every_spmd_backend`` trains TP under all three
backends, the same checks and the same losses; ``tests/test_titan03_placements.py`` checks every layout
under every backend without training.
Skipped unless TorchTitan 0.3.x is installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.titan03_support import require_titan03

require_titan03()

from tests import launch  # noqa: E402
from tests.test_torchtitan_layouts import all_names, comm_paths  # noqa: E402
from torchtitan_ext.titan_log import parse_log  # noqa: E402

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
RUN_TIMEOUT_S = 420
LLAMA3 = ["--module", "torchtitan_ext.titan03.configs", "--config", "llama3_debug_cpu"]
QWEN3_MOE = ["--module", "tests.titan03_support", "--config", "qwen3_moe_debug_cpu"]
SHORT = ["--training.steps", str(STEPS), "--metrics.log_freq", "1", "--validator.no-enable",
         "--lr_scheduler.warmup_steps", "2"]
# name: (config, flags, ranks, a Muon weight the run must log a path for)
LAYOUTS = {
    "hsdp_2x2": (LLAMA3, ["--parallelism.data_parallel_replicate_degree", "2",
                          "--parallelism.data_parallel_shard_degree", "2"], 4,
                 "layers.0.attention.qkv_linear.wqkv.weight"),
    "fsdp_2_x_tp_2": (LLAMA3, ["--parallelism.data_parallel_shard_degree", "2",
                               "--parallelism.tensor_parallel_degree", "2"], 4, "layers.0.attention.wo.weight"),
    "tp_2": (LLAMA3, ["--parallelism.data_parallel_shard_degree", "1",
                      "--parallelism.tensor_parallel_degree", "2"], 2, "layers.0.attention.wo.weight"),
    # 64 experts (2 blocks: tests/titan03_support.py): half the demo's tokens.
    "moe_ep_2": (QWEN3_MOE, ["--parallelism.expert_parallel_degree", "2", "--training.seq_len", "128"], 2,
                 "layers.0.moe.routed_experts.inner_experts.w1_EFD"),
}


def torchrun(dump_folder: Path, *args: str, nproc: int) -> str:
    """Run ``torchtitan.train`` on ``nproc`` CPU ranks; rank 0's console."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--local-ranks-filter=0", "-m", "torchtitan.train", "--dump_folder", str(dump_folder), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = launch.run(cmd, timeout_s=RUN_TIMEOUT_S, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def assert_trained_on_the_owner_exchange(console: str, weight: str) -> dict[int, float]:
    """The run logged every step, its loss went down, and every Muon matrix (``weight`` among
    them) took the owner exchange; its losses by step."""
    losses = parse_log(console).train_loss
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses[STEPS] < losses[1], losses
    paths = comm_paths(console)
    assert set(paths) == {"all_to_all"}, paths
    assert weight in all_names(paths)
    return losses


# TP alone trains in test_tp_2_trains_the_same_under_every_spmd_backend, the default backend first.
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "tp_2"])
def test_a_layout_trains_with_every_muon_matrix_on_the_owner_exchange(tmp_path, layout):
    config, flags, nproc, weight = LAYOUTS[layout]
    assert_trained_on_the_owner_exchange(torchrun(tmp_path, *config, *SHORT, *flags, nproc=nproc), weight)


BACKENDS = ("spmd_types", "full_dtensor", "partial_dtensor")
# Same math, different sharding machinery: losses agree up to reduction order.
BACKEND_LOSS_RTOL = 1e-5


def test_tp_2_trains_the_same_under_every_spmd_backend(tmp_path):
    config, flags, nproc, weight = LAYOUTS["tp_2"]
    losses = {}
    for backend in BACKENDS:
        console = torchrun(tmp_path / backend, *config, *SHORT, *flags, "--parallelism.spmd_backend", backend,
                           nproc=nproc)
        losses[backend] = assert_trained_on_the_owner_exchange(console, weight)
    reference = losses[BACKENDS[0]]
    for backend in BACKENDS[1:]:
        assert sorted(losses[backend]) == sorted(reference), backend
        for step, loss in reference.items():
            assert losses[backend][step] == pytest.approx(loss, rel=BACKEND_LOSS_RTOL), (backend, step)
