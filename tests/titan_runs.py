"""Launching real ``torchrun`` TorchTitan jobs from tests, and reading what they left behind.

Every launch is ``torchrun --standalone`` (a free port is picked) with
``OMP_NUM_THREADS=1`` and a timeout, through ``tests.launch``: a run that hangs is
stopped with every process it started, torchrun's workers included. Every rank's output is kept under
``<dump_folder>/torchrun_logs/<run id>/attempt_<n>/<rank>/`` and shown when a
run fails. The checkpoints a run writes are read with ``tests/checkpoints.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tests import launch
from tests.checkpoints import checkpoint_dir
from torchtitan_ext.titan_log import parse_log, TitanLog

REPO = Path(__file__).resolve().parents[1]
DMUON_TOML = REPO / "train_configs" / "llama3_debug_dmuon.toml"
ADAMW_TOML = REPO / "train_configs" / "llama3_debug_adamw.toml"
RUN_TIMEOUT_S = 300

# torchrun's agent shares its rendezvous TCPStore with the workers and keeps it
# across restarts without a per-attempt key prefix, so a restarted worker can read
# a key its dead predecessor wrote (pytorch/pytorch#135712); with gloo that shows
# up as "Gloo connectFullMesh failed ... Connection refused". This opt-out gives
# every attempt a fresh store. docs/reliability.md explains it.
RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# Environment variables of the test-only hooks (tests/titan_hooks/); a run that sets
# one imports the module that arms them instead of the extension's own job module.
HOOK_ENV_PREFIX = "TORCHTITAN_EXT_"
TEST_HOOKS_MODULE = "tests.titan_hooks.job"


class RunFailed(AssertionError):
    pass


def torchrun(toml: Path, dump_folder: Path, *overrides: str, nproc: int = 2, check: bool = True,
             log_rank: int = 0, max_restarts: int = 0, env: dict[str, str] | None = None,
             ) -> tuple[TitanLog, str]:
    """Run TorchTitan; return (TitanLog of rank ``log_rank``, its console text).

    With ``max_restarts`` the console holds every attempt; read one attempt with
    ``attempt_output``.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--local-ranks-filter={log_rank}",
        f"--max-restarts={max_restarts}",
        "--log-dir", str(rank_logs(dump_folder)), "--redirects", "3", "--tee", "3",
        "-m", "torchtitan.train",
        "--job.config_file", str(toml),
        "--job.dump_folder", str(dump_folder),
        *overrides,
    ]
    run_env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if max_restarts:
        run_env.update(RESTART_SAFE_ENV)
    run_env.update(env or {})
    if any(key.startswith(HOOK_ENV_PREFIX) for key in env or {}):
        cmd += ["--experimental.custom_import", TEST_HOOKS_MODULE]
    try:
        proc = launch.run(cmd, timeout_s=RUN_TIMEOUT_S, cwd=REPO, env=run_env)
    except launch.LaunchTimedOut as timed_out:
        raise RunFailed(f"{timed_out}{_tails(dump_folder)}") from None
    out = proc.stdout
    if check and proc.returncode != 0:
        raise RunFailed(f"torchrun exited with {proc.returncode}:\n{out[-6000:]}{_tails(dump_folder)}")
    return parse_log(out), out


def rank_logs(dump_folder: Path) -> Path:
    return dump_folder / "torchrun_logs"


def attempt_output(dump_folder: Path, attempt: int, rank: int = 0) -> str:
    """What one rank printed (stdout, then stderr) in one attempt of the last launch."""
    (folder,) = rank_logs(dump_folder).glob(f"*/attempt_{attempt}/{rank}")
    return (folder / "stdout.log").read_text() + (folder / "stderr.log").read_text()


def attempts(dump_folder: Path) -> list[int]:
    """The attempt numbers torchrun started (0 and, after a restart, 1, ...)."""
    return sorted(int(p.name.split("_")[1]) for p in rank_logs(dump_folder).glob("*/attempt_*"))


def _tails(dump_folder: Path) -> str:
    """The end of every rank's stderr (the console only shows one rank)."""
    files = sorted(rank_logs(dump_folder).rglob("stderr.log"))
    return "".join(f"\n--- {f} ---\n{f.read_text()[-2000:]}" for f in files)


def copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    """Give ``dst_run`` the checkpoint ``src_run`` wrote at ``step``, as if it had stopped there."""
    shutil.copytree(checkpoint_dir(src_run, step), checkpoint_dir(dst_run, step))
