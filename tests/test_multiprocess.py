"""tests/multiprocess.py judges a run by what every rank reported and by how every rank
exited: a rank that crashes after it reported fails the run."""

from __future__ import annotations

import atexit
import os

import pytest
import torch.distributed as dist

from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank


def _report_then_exit_1_on_the_last_rank() -> int:
    if dist.get_rank() == dist.get_world_size() - 1:
        atexit.register(os._exit, 1)  # after the report, as a crash at teardown would
    return dist.get_rank()


def _report_then_abort() -> int:
    atexit.register(os.abort)  # SIGABRT after the report, like the gloo abort at exit
    return dist.get_rank()


def test_a_rank_that_exits_1_after_reporting_fails_the_run():
    with pytest.raises(RuntimeError, match=r"every rank reported, then rank 1 exited with 1$"):
        run_on_ranks(_report_then_exit_1_on_the_last_rank, 2, timeout=60, fresh=True)


def test_a_rank_killed_by_sigabrt_after_reporting_fails_the_run_too():
    """No exit status is excused: clean ranks leave before gloo can abort them."""
    with pytest.raises(RuntimeError, match=r"every rank reported, then rank 0 was killed by SIGABRT$"):
        run_on_ranks(_report_then_abort, 1, timeout=60, fresh=True)
