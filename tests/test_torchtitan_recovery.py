"""A rank killed with SIGKILL mid-run: ``torchrun --max-restarts 1`` restarts the job,
which resumes from the last complete checkpoint and then matches an uninterrupted run
exactly.

The uninterrupted reference is the shared ``dmuon_run`` (10 DMuon steps on 2 ranks,
checkpoints at steps 5 and 10). Each scenario runs the same job with a fault armed
through ``tests.titan_hooks.fault_injection`` (environment variables), so the rank dies
at the same point every time:

* ``rank1_after_step7``: rank 1 dies after step 7, between two checkpoints;
* ``rank0_writing_step10``: rank 0 -- DCP's coordinator, which writes ``.metadata``
  last -- dies while the step-10 checkpoint is being written, after its own shard
  files are on disk, leaving a torn ``step-10`` folder.

Both must restart from ``step-5``. Launches use ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(``titan_runs.RESTART_SAFE_ENV``; docs/reliability.md, "Restarting after a killed rank", says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.checkpoints import assert_same_checkpoints, checkpoint_dir
from tests.titan_runs import attempt_output, attempts, DMUON_TOML, torchrun
from tests.titan_hooks.fault_injection import KillPlan, plan_from_env
from torchtitan_ext.launch_checks import restarts_share_a_stale_store
from torchtitan_ext.titan_log import parse_log

# Marked per test: the killed runs launch torchrun (torchrun); the checks of the fault's
# switch and of the launch check are plain functions of an environment (unit).


@dataclass(frozen=True)
class Scenario:
    kill: KillPlan
    killed_message: str  # what the killed rank logs just before it dies


SCENARIOS = {
    "rank1_after_step7": Scenario(
        KillPlan(rank=1, step=7, point="after_step"),
        "SIGKILL rank 1 at step 7, after the step"),
    "rank0_writing_step10": Scenario(
        KillPlan(rank=0, step=10, point="checkpoint_write"),
        "SIGKILL rank 0 at step 10, during the checkpoint write"),
}
LAST_COMPLETE_CHECKPOINT = 5  # in both scenarios


@pytest.fixture(scope="module", params=list(SCENARIOS))
def killed_run(request, tmp_path_factory, short_run_args) -> tuple[Scenario, Path]:
    """The reference job with one rank SIGKILLed, under ``torchrun --max-restarts 1``."""
    scenario = SCENARIOS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    env = {
        "TORCHTITAN_EXT_KILL_RANK": str(scenario.kill.rank),
        "TORCHTITAN_EXT_KILL_STEP": str(scenario.kill.step),
        "TORCHTITAN_EXT_KILL_POINT": scenario.kill.point,
    }
    torchrun(DMUON_TOML, folder, *short_run_args, "--checkpoint.enable", "--checkpoint.interval", "5",
             max_restarts=1, env=env)
    return scenario, folder


@pytest.mark.torchrun
@pytest.mark.extended
def test_the_armed_rank_kills_itself_at_the_chosen_point_in_the_first_attempt(killed_run):
    scenario, folder = killed_run
    first_attempt = attempt_output(folder, attempt=0, rank=scenario.kill.rank)
    assert scenario.killed_message in first_attempt
    # It died right there: it logged no later step.
    assert max(parse_log(first_attempt).train_loss) == scenario.kill.step


@pytest.mark.torchrun
@pytest.mark.extended
def test_torchrun_restarts_the_job_exactly_once(killed_run):
    _, folder = killed_run
    assert attempts(folder) == [0, 1]


@pytest.mark.torchrun
@pytest.mark.extended
def test_the_restarted_job_resumes_from_the_last_complete_checkpoint(killed_run):
    _, folder = killed_run
    restarted = attempt_output(folder, attempt=1, rank=0)
    assert "Loading the checkpoint" in restarted
    assert f"step-{LAST_COMPLETE_CHECKPOINT}" in restarted
    assert f"Training starts at step {LAST_COMPLETE_CHECKPOINT + 1}" in restarted


@pytest.mark.torchrun
@pytest.mark.extended
def test_the_restarted_job_logs_exactly_the_uninterrupted_losses(killed_run, dmuon_run):
    _, folder = killed_run
    uninterrupted, _ = dmuon_run
    restarted = parse_log(attempt_output(folder, attempt=1, rank=0)).train_loss
    expected_steps = list(range(LAST_COMPLETE_CHECKPOINT + 1, 11))
    assert sorted(restarted) == expected_steps
    # Printed with 5 decimals; the final-state test below compares bit for bit.
    assert restarted == {s: uninterrupted.train_loss[s] for s in expected_steps}


@pytest.mark.torchrun
@pytest.mark.extended
def test_the_restarted_job_ends_with_the_uninterrupted_model_and_optimizer_bit_for_bit(
        killed_run, dmuon_run, tmp_path):
    _, folder = killed_run
    _, uninterrupted_folder = dmuon_run
    assert_same_checkpoints(checkpoint_dir(folder, 10), checkpoint_dir(uninterrupted_folder, 10), tmp_path)


# ------------------------------------------------------------ the fault's switch


@pytest.mark.unit
def test_no_fault_is_armed_without_the_environment_variables():
    assert plan_from_env({"RANK": "1"}) is None


@pytest.mark.unit
def test_the_fault_is_armed_in_the_first_attempt_only():
    env = {"TORCHTITAN_EXT_KILL_RANK": "1", "TORCHTITAN_EXT_KILL_STEP": "7",
           "TORCHTITAN_EXT_KILL_POINT": "checkpoint_write"}
    assert plan_from_env({**env, "TORCHELASTIC_RESTART_COUNT": "0"}) == KillPlan(1, 7, "checkpoint_write")
    assert plan_from_env({**env, "TORCHELASTIC_RESTART_COUNT": "1"}) is None


@pytest.mark.unit
def test_an_unknown_kill_point_is_rejected_naming_the_choices():
    env = {"TORCHTITAN_EXT_KILL_RANK": "1", "TORCHTITAN_EXT_KILL_STEP": "7",
           "TORCHTITAN_EXT_KILL_POINT": "during_backward"}
    with pytest.raises(ValueError, match="after_step.*checkpoint_write"):
        plan_from_env(env)


# ------------------------------------------------------------ the launch check


@pytest.mark.unit
def test_restarts_with_torchruns_shared_store_are_flagged():
    env = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert restarts_share_a_stale_store(env)


@pytest.mark.unit
def test_restarts_with_a_fresh_store_per_attempt_are_not_flagged():
    # What torchrun sets under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
    env = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert not restarts_share_a_stale_store(env)


@pytest.mark.unit
def test_a_launch_without_restarts_is_not_flagged():
    env = {"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert not restarts_share_a_stale_store(env)
