"""A test launch that times out leaves no process behind (tests/launch.py): torchrun,
its workers (each in a session of its own) and whatever those started."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import launch

# Marked per test: the hanging launch runs torchrun (torchrun); the launches of a plain
# Python one-liner finish in a fraction of a second (unit).

# Each worker ignores SIGTERM (so torchrun's own teardown cannot stop it) and starts a
# grandchild in yet another session; both write their PIDs, then everything sleeps.
HANGING_WORKER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with open(os.path.join(sys.argv[1], f"pids.{os.getpid()}"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.torchrun
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")
@pytest.mark.extended
def test_a_torchrun_launch_that_hangs_is_stopped_with_every_process_it_started(tmp_path):
    worker = tmp_path / "hang.py"
    worker.write_text(HANGING_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(worker), str(tmp_path)]
    started = time.monotonic()
    with pytest.raises(launch.LaunchTimedOut):
        launch.run(cmd, timeout_s=20, env=dict(os.environ, OMP_NUM_THREADS="1"), grace_s=5)
    pids = [int(pid) for f in tmp_path.glob("pids.*") for pid in f.read_text().split()]
    assert len(pids) == 4, "both workers and their children should have started"
    assert not [pid for pid in pids if _alive(pid)]
    assert time.monotonic() - started < 60


@pytest.mark.unit
def test_a_launch_that_finishes_returns_its_output_and_exit_code():
    done = launch.run([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], timeout_s=30)
    assert (done.returncode, done.stdout) == (3, "hello\n")


@pytest.mark.unit
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")
def test_a_process_a_finished_launch_left_behind_is_stopped_too(tmp_path):
    pid_file = tmp_path / "orphan"
    script = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
              f"start_new_session=True); open({str(pid_file)!r}, 'w').write(str(child.pid))")
    assert launch.run([sys.executable, "-c", script], timeout_s=30).returncode == 0
    assert not _alive(int(pid_file.read_text()))
