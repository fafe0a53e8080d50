"""benchmarks.spawned_ranks, the launcher of the multi-rank tests and of ``benchmarks.vs_distmuon --time``:
results in rank order, a rank's error raised with its traceback, and a run that outlives
its timeout stopped with no process left behind."""

from __future__ import annotations

import multiprocessing as mp
import operator
import time

import pytest

from benchmarks.spawned_ranks import run_on_ranks

pytestmark = pytest.mark.multirank


def test_results_come_back_in_rank_order_and_a_failure_is_raised_with_its_traceback():
    assert run_on_ranks(operator.add, 2, 1, 2, timeout=120) == [3, 3]
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        run_on_ranks(operator.truediv, 1, 1, 0, timeout=120)
    assert mp.active_children() == []


def test_a_run_past_its_timeout_is_killed_whole():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        run_on_ranks(time.sleep, 1, 600, timeout=5)  # whether it got to sleep or not
    assert time.monotonic() - start < 60
    assert mp.active_children() == []
