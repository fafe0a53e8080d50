"""Run a function on P gloo ranks of spawned processes, one torch thread each, with a
timeout, and leave no process behind.

``python -m benchmarks.vs_distmuon --time`` measures P = 1, 2 and 4 from one command,
which torchrun (one world size a launch) cannot do. It follows ``tests/multiprocess.py``
(not imported: the benchmarks do not depend on the tests) in what matters for a
measurement that must not hang or linger:

- a run that outlives its timeout, or a rank that fails or dies, kills every process
  of the run before the error is raised;
- a rank that reported waits until every rank has (rank 0 holds the store), destroys
  its group, then ends with ``os._exit(0)``: gloo's worker threads can abort a process
  during interpreter finalization (docs/reliability.md), which would turn a good run
  into a failed one;
- a rank that does not exit within ``EXIT_GRACE_S`` after reporting fails the run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

EXIT_GRACE_S = 30.0
# How often the parent looks at its ranks while it waits for their results.
POLL_S = 1.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
               results: Any, all_reported: Any) -> None:
    """One rank: a gloo group, ``fn(*args)``, its result (or traceback) to the parent."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, "ok", fn(*args)))
        all_reported.wait()
        dist.destroy_process_group()
    except BaseException:  # every failure goes to the parent, which then kills the run
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()  # the queue's feeder thread sends it: wait for that before exiting
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _collect(procs: list, results: Any, name: str, timeout_s: float) -> dict[int, Any]:
    """Every rank's result; raises on a timeout, a rank's error or a rank that died silently."""
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(collected) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{name} on {len(procs)} rank(s) did not finish in {timeout_s:.0f} s "
                               f"(ranks done: {sorted(collected)})")
        try:
            rank, status, value = results.get(timeout=min(left, POLL_S))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (0, None)]
            if dead and results.empty():
                raise RuntimeError(f"{name}: rank(s) {dead} died without reporting") from None
            continue
        if status == "error":
            raise RuntimeError(f"{name} failed on rank {rank}:\n{value}")
        collected[rank] = value
    return collected


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float) -> list[Any]:
    """``[fn(*args) on rank 0, ..., rank world_size - 1]``, each rank a spawned process in
    one gloo group; ``fn`` must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    results, all_reported = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results, all_reported), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        collected = _collect(procs, results, fn.__name__, timeout_s)
        all_reported.set()
        exit_by = time.monotonic() + EXIT_GRACE_S
        for proc in procs:
            proc.join(timeout=max(0.0, exit_by - time.monotonic()))
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"{fn.__name__}: rank(s) {failed} reported, then did not exit cleanly")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        results.close()
    return [collected[r] for r in range(world_size)]
