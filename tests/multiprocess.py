"""Run a function on P real ranks (spawned processes, one thread each): the launcher of
the multi-rank tests, ``benchmarks.spawned_ranks`` (a timeout on every run, every rank
judged by what it reported; its docstring says how).

By default a scenario runs on the shared ranks of its world size
(``benchmarks.spawned_ranks.RankPool``): one launch, one process group, for every
scenario of that size in this pytest process, which saves a launch (about 3 s at P = 2,
6 s at P = 4 on 2 cores) per scenario. A scenario that fails or hangs still fails its own
test, named, and the ranks are started anew for the next one. ``fresh=True`` gives a
scenario processes of its own: what judges how ranks exit, registers ``atexit`` handlers,
or may leave a desynchronized group behind (the fault sweep)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.spawned_ranks import DEFAULT_TIMEOUT_S, EXIT_TIMEOUT_S, free_port, run_on_shared_ranks
from benchmarks.spawned_ranks import run_on_ranks as run_on_fresh_ranks

__all__ = ["DEFAULT_TIMEOUT_S", "EXIT_TIMEOUT_S", "free_port", "run_on_ranks"]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                 backend: str = "gloo", fresh: bool = False) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]`` (module docstring: shared
    ranks unless ``fresh``; NCCL ranks are always fresh, one GPU each)."""
    if fresh or backend != "gloo":
        return run_on_fresh_ranks(fn, world_size, *args, timeout=timeout, backend=backend)
    return run_on_shared_ranks(fn, world_size, *args, timeout=timeout)
