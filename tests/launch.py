"""Run a command that starts processes of its own (torchrun and its workers) with a
timeout, and leave none of them behind.

torchrun starts each worker in a session of its own, so killing torchrun's process
group does not reach them: a timed-out run would leave its workers spinning (parent
PID 1), slowing every later test. So every launch carries a token in its environment,
which each process it starts inherits whatever its session, and the launch ends with:

1. SIGTERM to the launcher's process group: torchrun then tears its workers down
   (SIGTERM, then SIGKILL after its own timeout);
2. after ``grace_s``, SIGKILL to every process still carrying the token, and to its
   process group.

Step 2 also runs after a launch that exited by itself, so a worker a finished
torchrun failed to reap does not outlive the test either.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

# The environment variable that marks every process of one launch.
LAUNCH_TOKEN_VAR = "DMUON_TEST_LAUNCH"
DEFAULT_GRACE_S = 10.0


class LaunchTimedOut(AssertionError):
    """The launch outlived its timeout; every process of it has been stopped."""

    def __init__(self, timeout_s: float, output: str) -> None:
        super().__init__(f"launch timed out after {timeout_s:.0f} s:\n{output[-4000:]}")
        self.output = output


def run(cmd: Sequence[str], *, timeout_s: float, cwd: Path | str | None = None,
        env: dict[str, str] | None = None, grace_s: float = DEFAULT_GRACE_S) -> subprocess.CompletedProcess:
    """Run ``cmd`` (stdout and stderr together, as text); raise :class:`LaunchTimedOut`
    once every process of a run that outlived ``timeout_s`` is gone."""
    token = uuid.uuid4().hex
    run_env = dict(os.environ if env is None else env, **{LAUNCH_TOKEN_VAR: token})
    timed_out = False
    # Output goes to a file, not a pipe: a leftover process holding a pipe open would
    # keep a reader waiting after the launcher itself has exited.
    with tempfile.TemporaryFile("w+") as output:
        # A new session: the launcher's process group is ours to signal, and not pytest's.
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=run_env, stdout=output, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            kill_leftovers(token)
        output.seek(0)
        out = output.read()
    if timed_out:
        raise LaunchTimedOut(timeout_s, out)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def processes_of(token: str) -> list[int]:
    """PIDs of the live processes whose environment carries ``token`` (Linux /proc)."""
    marker = f"{LAUNCH_TOKEN_VAR}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0") and _state(entry) != "Z":
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def kill_leftovers(token: str, wait_s: float = 10.0) -> None:
    """SIGKILL every process of the launch, and its process group; wait until none is left."""
    deadline = time.monotonic() + wait_s
    while pids := processes_of(token):
        for pid in pids:
            try:
                group = os.getpgid(pid)
                if group != os.getpgrp():
                    os.killpg(group, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of launch {token} survived SIGKILL")
        time.sleep(0.1)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _state(proc_dir: Path) -> str:
    """The one-letter state of a process (``Z``: a zombie, already dead)."""
    stat = (proc_dir / "stat").read_text()
    return stat[stat.rindex(")") + 2]
