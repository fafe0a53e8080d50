"""Run a function on P real ranks (spawned processes, one thread each).

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes on a free
localhost port, runs ``fn(*args)`` in each after ``init_process_group("gloo")`` (or
``backend="nccl"``: one GPU per rank) and returns the per-rank results. A worker's exception is re-raised in the caller with
its traceback; a run that outlives ``timeout`` is killed, every process of it, and
raises ``TimeoutError`` so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple,
            results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        value = fn(*args)
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                 backend: str = "gloo") -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, results), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    collected: dict[int, tuple[str, Any]] = {}
    try:
        start = time.monotonic()
        while len(collected) < world_size:
            deadline_left = timeout - (time.monotonic() - start)
            if deadline_left <= 0:
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s "
                                   f"(ranks done: {sorted(collected)})")
            try:
                rank, status, value = results.get(timeout=min(deadline_left, 1.0))
            except queue.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs) and results.empty():
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (0, None)]
                    raise RuntimeError(f"{fn.__name__}: rank(s) {dead} died without reporting") from None
                continue
            collected[rank] = (status, value)
            if status == "error":
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        results.close()
    return [collected[r][1] for r in range(world_size)]
