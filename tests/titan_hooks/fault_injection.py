"""Kill one rank with SIGKILL at a chosen point of a TorchTitan run (for recovery tests).

Recovery tests need a rank to die at a *known* point -- a timer-based
``kill -9`` from outside lands anywhere, so two test runs would test different
things. Three environment variables, read when ``tests.titan_hooks.job`` is imported,
arm the fault; nothing happens when ``TORCHTITAN_EXT_KILL_RANK`` is unset::

    TORCHTITAN_EXT_KILL_RANK=1            # global rank that kills itself
    TORCHTITAN_EXT_KILL_STEP=7            # training step at which it does so
    TORCHTITAN_EXT_KILL_POINT=after_step  # or checkpoint_write

* ``after_step``: once step N has run (its loss is logged) and before its
  checkpoint, if any, is saved;
* ``checkpoint_write``: while the step-N checkpoint is being written, after this
  rank's shard files are on disk and before DCP writes ``.metadata`` -- the
  checkpoint folder exists but is incomplete.

The fault fires only in the first attempt of a ``torchrun`` job
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so the restarted attempt runs
through. The rank kills itself with SIGKILL: no Python cleanup, no exit
handlers, no flushed sockets -- the same as ``kill -9`` from outside.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

from torchtitan.tools.logging import logger

POINTS = ("after_step", "checkpoint_write")


@dataclass(frozen=True)
class KillPlan:
    rank: int
    step: int
    point: str


def plan_from_env(env: dict[str, str] | os._Environ = os.environ) -> KillPlan | None:
    """The armed fault for this process, or None (unset, or not the first attempt)."""
    if "TORCHTITAN_EXT_KILL_RANK" not in env:
        return None
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
        return None
    point = env.get("TORCHTITAN_EXT_KILL_POINT", "after_step")
    if point not in POINTS:
        raise ValueError(f"TORCHTITAN_EXT_KILL_POINT={point!r}; expected one of {POINTS}")
    return KillPlan(int(env["TORCHTITAN_EXT_KILL_RANK"]), int(env["TORCHTITAN_EXT_KILL_STEP"]), point)


def _kill_self(message: str) -> None:
    logger.warning(message)
    # The log line is the test's evidence of where the rank died: flush it first.
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(plan: KillPlan) -> None:
    """Patch TorchTitan's checkpoint save (and DCP's file writer) to run ``plan``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torchtitan.components.checkpoint import CheckpointManager

    if int(os.environ.get("RANK", "0")) != plan.rank:
        return
    where = f"rank {plan.rank} at step {plan.step}"
    current_step: list[int] = [0]  # the step whose checkpoint CheckpointManager.save handles

    # Trainer.train calls checkpointer.save(step) right after every train_step(step),
    # whether or not that step is a checkpoint step: the hook point for "after_step".
    original_save: Callable[..., Any] = CheckpointManager.save

    @functools.wraps(original_save)
    def save(self: CheckpointManager, curr_step: int, *args: Any, **kwargs: Any) -> None:
        current_step[0] = curr_step
        if plan.point == "after_step" and curr_step == plan.step:
            _kill_self(f"torchtitan_ext fault injection: SIGKILL {where}, after the step")
        return original_save(self, curr_step, *args, **kwargs)

    original_write: Callable[..., Any] = FileSystemWriter.write_data

    @functools.wraps(original_write)
    def write_data(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        result = original_write(self, *args, **kwargs)
        if plan.point == "checkpoint_write" and current_step[0] == plan.step:
            result.wait()  # this rank's shard files are complete on disk
            _kill_self(f"torchtitan_ext fault injection: SIGKILL {where}, during the checkpoint write")
        return result

    CheckpointManager.save = save
    FileSystemWriter.write_data = write_data
    logger.warning(f"torchtitan_ext fault injection armed: {plan}")


def install_from_env() -> None:
    plan = plan_from_env()
    if plan is not None:
        write_error_files_whole()
        install(plan)


def write_error_files_whole() -> None:
    """Make this rank write its torchelastic error file whole or not at all (a temporary file,
    then a rename).

    When a rank dies, torchrun stops the others and reads each failed rank's error file.
    torch writes that file in place (``ErrorHandler._write_error_file``: ``open(path, "w")``),
    so a surviving rank stopped while writing it leaves it empty, and the agent itself then
    fails on the empty JSON (``json.decoder.JSONDecodeError`` in ``ProcessFailure``) instead
    of restarting the job. Seen once, in the clean-clone CI run of a40ff0b (2026-11-28, the
    ``rank0_writing_step10`` scenario); a torch race, not the scenario's point, so the
    recovery tests' ranks write the file atomically."""
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    def write_whole(self: Any, file_path: str, error_msg: str) -> None:
        partial = f"{file_path}.partial"
        try:
            with open(partial, "w") as fp:
                fp.write(error_msg)
            os.replace(partial, file_path)
        except OSError as e:
            logger.warning(f"Unable to write error to file. {type(e).__name__}: {e}")

    ErrorHandler._write_error_file = write_whole
