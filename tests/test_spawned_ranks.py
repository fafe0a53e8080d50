"""benchmarks.spawned_ranks, the launcher of the multi-rank tests and of ``benchmarks.vs_distmuon --time``:
results in rank order, a rank's error raised with its traceback, and a run that outlives
its timeout stopped with no process left behind; the same for the shared ranks
(``RankPool``), which run many functions in one launch and start anew after a failure."""

from __future__ import annotations

import multiprocessing as mp
import operator
import os
import time

import pytest
import torch.distributed as dist

from benchmarks.spawned_ranks import RankPool, run_on_ranks

pytestmark = pytest.mark.multirank


def _pid_and_rank() -> tuple[int, int]:
    return os.getpid(), dist.get_rank()


def _raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    return dist.get_rank()


def _raise_planted() -> None:
    raise ValueError("planted failure")


def _all_reduce_then_hang_on_rank_0() -> None:
    import torch

    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 0:
        time.sleep(600)


def _children() -> set[int]:
    return {child.pid for child in mp.active_children()}


def test_results_come_back_in_rank_order_and_a_failure_is_raised_with_its_traceback():
    before = _children()
    assert run_on_ranks(operator.add, 2, 1, 2, timeout=120) == [3, 3]
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        run_on_ranks(operator.truediv, 1, 1, 0, timeout=120)
    assert _children() <= before


def test_a_run_past_its_timeout_is_killed_whole():
    before = _children()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        run_on_ranks(time.sleep, 1, 600, timeout=5)  # whether it got to sleep or not
    assert time.monotonic() - start < 60
    assert _children() <= before


def test_shared_ranks_run_each_function_on_the_same_processes_in_rank_order():
    pool = RankPool(2)
    try:
        first = pool.run(_pid_and_rank, timeout=120)
        assert [rank for _, rank in first] == [0, 1]
        assert pool.run(_pid_and_rank, timeout=120) == first
        assert pool.run(operator.mul, 3, 4, timeout=60) == [12, 12]
    finally:
        pool.close()


def test_a_failure_on_shared_ranks_names_the_function_and_rank_and_ends_every_rank():
    pool = RankPool(2)
    pids = {pid for pid, _ in pool.run(_pid_and_rank, timeout=120)}
    with pytest.raises(RuntimeError, match=r"(?s)_raise_on_rank_1 failed on rank 1:.*planted failure on rank 1"):
        pool.run(_raise_on_rank_1, timeout=60)
    assert not pool.alive
    assert not pids & _children()


def test_a_hang_on_shared_ranks_is_reported_by_name_within_its_timeout_with_no_rank_left():
    pool = RankPool(2)
    pids = {pid for pid, _ in pool.run(_pid_and_rank, timeout=120)}
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_all_reduce_then_hang_on_rank_0 on 2 shared ranks did not finish in 5 s "
                                           r"\(ranks done: \[1\]\)"):
        pool.run(_all_reduce_then_hang_on_rank_0, timeout=5)
    assert time.monotonic() - start < 30
    assert not pids & _children()


def test_closing_shared_ranks_ends_each_with_exit_status_0():
    pool = RankPool(2)
    processes = list(pool.processes)
    pool.run(_pid_and_rank, timeout=120)
    pool.close()
    assert [proc.exitcode for proc in processes] == [0, 0]


def test_a_pool_closed_or_killed_can_be_closed_again_as_at_exit():
    pool = RankPool(1)
    with pytest.raises(RuntimeError, match="planted failure"):
        pool.run(_raise_planted, timeout=60)
    pool.close()
    pool.kill()
    assert not pool.alive
