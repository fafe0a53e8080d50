"""Resuming on 2 gloo ranks, through state_dict and through DCP, continues bit for bit."""

from __future__ import annotations

import pytest

from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def resumed() -> dict[str, bool]:
    return run_on_ranks(scenarios.state_dict_resume, 2)[0]


def test_load_state_dict_resumes_bitwise(resumed):
    assert resumed["state_dict"]


def test_dcp_save_and_load_resumes_bitwise(resumed):
    assert resumed["dcp"]


@pytest.fixture(scope="module")
def copies() -> list[dict[str, dict[str, bool]]]:
    """Every rank's figures (one launch for both kinds of copy)."""
    return run_on_ranks(scenarios.copies_step_like_the_original, 2)


@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_a_copy_of_a_dmuon_over_dtensors_steps_bitwise_like_the_original(copies, copy_of):
    """As torch's optimizers do (``test_torch_optim_contract.py``), with DTensor
    parameters on 2 ranks whose owner plan the copy rebuilds: every rank judged."""
    assert [rank[copy_of] for rank in copies] == [{"params": True, "state": True}] * 2


@pytest.fixture(scope="module")
def log_lines() -> list[str]:
    """What a process logs from its first DMuon on: ranks of its own (a shared rank has
    logged the once-per-process lines already)."""
    return run_on_ranks(scenarios.path_log, 2, fresh=True)[0]


def test_each_path_is_logged_once_with_its_parameters(log_lines):
    assert [line for line in log_lines if "path" in line] == [
        "DMuon: 7 Muon parameter(s) use the all_to_all path: square, tall, empty_shard, wide, uneven, experts_3d, "
        "col_sharded",
        "DMuon: 1 Muon parameter(s) use the redistribute path: conv",
    ]


def test_the_auto_compute_dtype_is_logged_once_per_process(log_lines):
    (line,) = [line for line in log_lines if "ns_dtype" in line]
    assert line.startswith("DMuon: ns_dtype='auto' runs Newton-Schulz in ")


@pytest.fixture(scope="module")
def normuon_resumed(tmp_path_factory) -> dict[int, dict[str, bool]]:
    """A DCP checkpoint with NorMuon (and cautious decay) state written on 2 ranks after
    2 steps, resumed for 2 more steps on 4 ranks and on 1."""
    checkpoint = str(tmp_path_factory.mktemp("normuon_dcp"))
    run_on_ranks(scenarios.variants_checkpoint_save, 2, checkpoint, 2)
    return {world: run_on_ranks(scenarios.variants_checkpoint_resume, world, checkpoint, 2, 4)[0] for world in (4, 1)}


@pytest.mark.parametrize("world", [4, 1])
def test_a_normuon_checkpoint_from_two_ranks_resumes_bitwise_on_other_world_sizes(normuon_resumed, world):
    assert normuon_resumed[world] == dict.fromkeys([name for name, _, _ in scenarios.CASES], True)
