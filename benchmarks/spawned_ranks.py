"""Run a function on P real ranks: spawned processes, one torch thread each, a timeout on
every launch, no process left behind. The one launcher of the project's multi-rank work:
``python -m benchmarks.vs_distmuon --time`` measures P = 1, 2 and 4 from one command (which
torchrun, one world size a launch, cannot), and the multi-rank tests run their scenarios
with it (``tests/multiprocess.py``), most of them on shared ranks (``RankPool``, below:
one launch for many functions).

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes on a free
localhost port, runs ``fn(*args)`` in each after ``init_process_group("gloo")`` (or
``backend="nccl"``: one GPU per rank) and returns the per-rank results. A worker's
exception is re-raised in the caller with its traceback; a run that outlives ``timeout``
is killed, every process of it, and raises ``TimeoutError``, so a hang fails instead of
stalling. A rank that reported but then exits other than 0 (a crash, an abort, an exit
code at teardown), or does not exit within ``EXIT_TIMEOUT_S``, fails the run too.

A rank that reported waits until every rank has (rank 0 holds the store that ranks
still setting up groups need), then destroys its process group. One that finished
cleanly (reported, group destroyed, no exception) ends with ``os._exit(0)`` from an
``atexit`` handler, after every handler ``fn`` registered and before interpreter
finalization. That keeps it clear of the gloo abort at exit that
docs/reliability.md describes (a gloo worker thread that frees a tensor during
finalization takes the process down with SIGABRT, ``terminate called without an active
exception``: pytorch/pytorch#190489, #130345; ``torchtitan_ext/clean_exit.py`` does the
same for TorchTitan jobs). So no exit status is excused: every rank must exit 0.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 180.0
# How long a rank that reported may take to exit.
EXIT_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple,
            results: Any, all_reported: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    finished = []
    # Registered before fn runs, so it runs after every atexit handler fn registers.
    atexit.register(_exit_before_finalization, finished)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        value = fn(*args)
        results.put((rank, "ok", value))
        all_reported.wait()  # set by the parent; it kills the ranks instead if one fails
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
        return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    finished.append(True)  # reported, group destroyed: nothing raised


def _exit_before_finalization(finished: list) -> None:
    """End a rank that finished cleanly with status 0 before interpreter finalization,
    where gloo's worker threads can abort it (module docstring); any other exit is left
    to Python."""
    if not finished:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_status(code: int | None) -> str:
    if code is None:
        return f"did not exit within {EXIT_TIMEOUT_S:.0f} s"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}"


def _collect(name: str, procs: list[Any], results: Any, timeout: float, ranks: str) -> dict[int, Any]:
    """Each rank's reported value (rank -> value) once every rank of ``procs`` has reported
    ``(rank, "ok" or "error", value)`` on ``results``. Raises, naming ``name``, when a rank
    reports an error (with its traceback), dies without reporting, or ``timeout`` passes
    (``ranks`` says which ranks in that message)."""
    collected: dict[int, Any] = {}
    start = time.monotonic()
    while len(collected) < len(procs):
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            raise TimeoutError(f"{name} on {len(procs)} {ranks} did not finish in {timeout:.0f} s "
                               f"(ranks done: {sorted(collected)})")
        try:
            rank, status, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = {r: _exit_status(p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)}
            if dead and results.empty():
                raise RuntimeError(f"{name}: rank(s) {sorted(dead)} died without reporting ("
                                   + "; ".join(f"rank {r} {how}" for r, how in dead.items()) + ")") from None
            continue
        if status == "error":
            raise RuntimeError(f"{name} failed on rank {rank}:\n{value}")
        collected[rank] = value
    return collected


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                 backend: str = "gloo") -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    all_reported = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, results, all_reported),
                         daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        collected = _collect(fn.__name__, procs, results, timeout, "ranks")
        all_reported.set()
        exit_by = time.monotonic() + EXIT_TIMEOUT_S
        for proc in procs:
            proc.join(timeout=max(0.0, exit_by - time.monotonic()))
        failed = {r: _exit_status(p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0}
        if failed:
            raise RuntimeError(f"{fn.__name__}: every rank reported, then "
                               + "; ".join(f"rank {r} {how}" for r, how in failed.items()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        results.close()
    return [collected[r] for r in range(world_size)]


# ------------------------------------------------------------------ shared ranks


class RankPool:
    """``world_size`` ranks kept alive across calls: one launch (interpreters, torch's
    import, the process group) for many functions, each run on every rank in turn.

    :meth:`run` has :func:`run_on_ranks`'s contract for one function: results in rank
    order, a rank's exception raised with its traceback and the function's name, a run
    past its ``timeout`` raising ``TimeoutError``. After any failure the pool is closed
    (every process killed): a rank that raised may have left the others inside a
    collective, so the next call starts fresh ranks rather than trust them.

    What a function leaves in its process (groups and meshes it made, module caches)
    stays for the next one: what needs a process of its own uses :func:`run_on_ranks`.
    A function after which the ranks disagree on how many groups they made (groups made by
    some ranks only) closes the pool once its results are in: the next group would hang.
    Ranks end with ``os._exit(0)`` at :meth:`close` (no finalization, so no gloo abort)."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.backend = backend
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [ctx.Process(target=_pool_worker, args=(r, world_size, port, backend, self._jobs[r],
                                                                self._results), daemon=True)
                       for r in range(world_size)]
        for proc in self._procs:
            proc.start()

    @property
    def processes(self) -> tuple[Any, ...]:
        """The ranks' processes, rank 0 first (none once the pool is closed)."""
        return tuple(self._procs)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """``[fn(*args) on rank 0, ..., on rank world_size - 1]``, on this pool's ranks."""
        for jobs in self._jobs:
            jobs.put((fn, args))
        try:
            collected = _collect(fn.__name__, self._procs, self._results, timeout, "shared ranks")
        except BaseException:  # the ranks may be inside a collective: none is trusted again
            self.kill()
            raise
        if len({groups for _, groups in collected.values()}) > 1:
            self.close()  # the ranks no longer agree on the next group's name (_groups_made)
        return [collected[r][0] for r in range(self.world_size)]

    def close(self) -> None:
        """End every rank (each exits 0 before finalization); kill what does not exit in time.
        Nothing to do once closed or killed."""
        if not self._procs:
            return
        for jobs in self._jobs:
            jobs.put(None)
        exit_by = time.monotonic() + EXIT_TIMEOUT_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, exit_by - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank now (after a failure: ranks may be stuck in a collective)."""
        if not self._procs:
            return
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        self._procs = []
        for q in (*self._jobs, self._results):
            q.close()
            q.cancel_join_thread()


def _groups_made() -> int | None:
    """How many process groups this rank has made: torch names a new group by this count
    unless it is made by its members only (``use_local_synchronization=True``, which DMuon
    uses for a pipeline stage's ranks, and non-members do not count). Ranks that disagree
    would wait on different names at their next ``new_group``: a hang."""
    from torch.distributed import distributed_c10d

    return getattr(getattr(distributed_c10d, "_world", None), "group_count", None)


def _pool_worker(rank: int, world_size: int, port: int, backend: str, jobs: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (job := jobs.get()) is not None:
        fn, args = job
        torch.set_num_threads(1)  # whatever the last function set
        try:
            value = fn(*args)
            results.put((rank, "ok", (value, _groups_made())))
        except BaseException:  # reported; the parent then kills every rank
            results.put((rank, "error", traceback.format_exc()))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_POOLS: dict[tuple[int, str], RankPool] = {}


def run_on_shared_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                        backend: str = "gloo") -> list[Any]:
    """:func:`run_on_ranks` on this process's :class:`RankPool` of ``world_size`` ranks
    (started at the first call, started anew after a failure, closed at exit)."""
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive:
        pool = _POOLS[key] = RankPool(world_size, backend)
    return pool.run(fn, *args, timeout=timeout)


@atexit.register
def _close_pools() -> None:  # registered after multiprocessing's own handler, so it runs first
    while _POOLS:
        _POOLS.popitem()[1].close()
