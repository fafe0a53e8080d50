"""The rule that every test says what it needs, the groups that keep launches apart under
pytest-xdist, fixtures shared by the TorchTitan end-to-end test files, and the
in-process ones (one thread, a one-rank gloo group).

Every test carries exactly one of the marks in ``TEST_KINDS`` (registered in
pyproject.toml); collecting one without, or with two, stops the run, so that
``pytest -m unit`` stays the whole in-process suite and nothing slow slips into it.

One uninterrupted 2-rank DMuon run (``dmuon_run``) is the reference for the
resume tests in ``test_torchtitan_e2e.py`` and the killed-rank tests in
``test_torchtitan_recovery.py``; session scope makes it run once per pytest
session, however many files use it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TEST_KINDS = ("unit", "multirank", "torchrun", "cuda")
# Under pytest-xdist (``-n 2 --dist loadgroup``, scripts/test.sh), the tests that start
# processes run in two groups, each in one worker in file order: the multi-rank (and cuda)
# tests, on one set of shared ranks per world size (tests/multiprocess.py), and the torchrun
# jobs; the in-process tests fill both workers. At most two launches run at once, one of
# each kind: a TorchTitan job leaves a core idle much of its time (start-up, checkpoints,
# gloo waits). Back to back, the default tier took 8:21 with every launch in one worker and
# 7:11 with the two groups; spreading launches test by test over both workers (two sets of
# shared ranks) was slower still on an earlier tree (docs/development.md).
LAUNCHING_KINDS = ("multirank", "torchrun", "cuda")
# Tests whose outcome does not depend on the torch release (documents, the import layers,
# the launchers, the planner's pure functions of shapes): marked ``any_torch``, run by the
# main suite only, not again by the torch 2.15 and 2.11 legs (docs/development.md).
ANY_TORCH_FILES = frozenset({
    "test_docs_links.py", "test_docs_module_paths.py", "test_layers.py", "test_package_boundaries.py",
    "test_spawned_ranks.py", "test_multiprocess.py", "test_launch_hygiene.py",
    "test_plan_report.py", "test_plan_answers.py", "test_cost_model.py", "test_titan_log.py",
    "test_suite_schedule.py", "test_plan_memory.py", "test_mutants.py", "test_docs_architecture.py",
})
# The multi-rank files every torch leg runs (marked ``every_torch``): exactness on every
# layout at P = 1, 2 and 4, the 2 x 2 meshes, TorchTitan's own layouts and DCP resharding,
# on shared ranks. The rest of the multi-rank tests run on the main leg only: what they
# check (faults, transport, telemetry, offload waits) is dmuon's own host logic, and their
# torch-dependent part (DTensor, FSDP2, DCP, gloo) is what these files exercise.
EVERY_TORCH_FILES = frozenset({
    "test_distributed_exactness.py", "test_distributed_meshes.py", "test_distributed_titan_layouts.py",
    "test_distributed_state.py",
})


@pytest.hookimpl(tryfirst=True)  # before -m deselects: an unmarked test fails every run, not only unfiltered ones
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        kinds = sorted({mark.name for mark in item.iter_markers() if mark.name in TEST_KINDS})
        if len(kinds) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(kinds) or 'none'}")
    if wrong:
        raise pytest.UsageError(
            f"every test needs exactly one of the marks {', '.join(TEST_KINDS)} (pyproject.toml says what each "
            f"means; set pytestmark in the module or mark the test). These have none or several:\n"
            + "\n".join(wrong))


def pytest_itemcollected(item: pytest.Item) -> None:
    """The marks this file sets by rule, as each test is collected: before any
    ``pytest_collection_modifyitems`` (xdist's reads ``xdist_group`` in its own, which runs
    ahead of a conftest's)."""
    if item.get_closest_marker("torchrun"):
        item.add_marker(pytest.mark.xdist_group("torchruns"))
    elif any(item.get_closest_marker(kind) for kind in LAUNCHING_KINDS):
        item.add_marker(pytest.mark.xdist_group("launches"))
    if item.path.name in ANY_TORCH_FILES:
        item.add_marker(pytest.mark.any_torch)
    if item.path.name in EVERY_TORCH_FILES:
        item.add_marker(pytest.mark.every_torch)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from torchtitan_ext.tokenizer import ensure_tokenizer

    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def short_run_args(tokenizer_dir) -> list[str]:
    """Overrides that make the demo config a ~10-step test."""
    return [
        "--model.hf_assets_path", str(tokenizer_dir),
        "--training.seq_len", "128",
        "--training.steps", "10",
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--validation.no-enable",
    ]


@pytest.fixture(scope="session")
def dmuon_run(tmp_path_factory, short_run_args):
    """10 DMuon steps on 2 ranks, checkpointing at steps 5 and 10: (TitanLog, dump folder)."""
    from tests.titan_runs import DMUON_TOML, torchrun

    folder = tmp_path_factory.mktemp("dmuon_run")
    log, _ = torchrun(DMUON_TOML, folder, *short_run_args,
                      "--checkpoint.enable", "--checkpoint.interval", "5")
    return log, folder


@pytest.fixture
def one_rank_gloo():
    """A world-size-1 gloo group in this process: enough for DTensors on a one-rank mesh
    and for DCP's state-dict helpers."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_thread():
    """Bitwise comparisons need the same reduction order: one torch thread for the test."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
