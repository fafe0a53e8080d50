"""``ReplayTally`` (``dmuon.exchange.status_masks``) and ``GradStatus.count_replays``: what the
replays of a captured step found, counted on the device and read by ``CapturedStep.check``
(issue 50). The statuses are written by hand here, as the device sums of two parameters
``a`` and ``b`` over two ranks: [with a grad, without one, disagreeing elsewhere, Partial]
per parameter, then [ranks with a problem, ranks with a non-finite grad]."""

from __future__ import annotations

import pytest
import torch

from dmuon.exchange.grad_status import GradStatus
from dmuon.exchange.status_masks import STATUS_DTYPE, ReplayTally

pytestmark = pytest.mark.unit

NAMES = ["a", "b"]
CLEAN = [2, 2, 0, 0, 0, 0, 0, 0, 0, 0]
NONFINITE = [2, 2, 0, 0, 0, 0, 0, 0, 0, 1]
A_ON_ONE_RANK = [1, 2, 1, 0, 0, 0, 0, 0, 0, 0]  # 'a' has a grad on one rank, not on the other
A_ON_ONE_RANK_AND_NONFINITE = [1, 2, 1, 0, 0, 0, 0, 0, 0, 1]


def _replayed(*statuses: list[int]) -> ReplayTally:
    tally = ReplayTally(NAMES, torch.device("cpu"))
    for status in statuses:
        tally.add_(torch.tensor(status, dtype=STATUS_DTYPE))
    return tally


def test_each_skipped_replay_is_counted_once_whichever_replay_it_was():
    status, tally = GradStatus(), _replayed(NONFINITE, CLEAN, NONFINITE, CLEAN)
    assert status.count_replays(tally) is None
    assert status.count_replays(tally) is None  # read again: nothing new
    assert status.skipped_steps == 2


def test_a_replay_with_an_error_is_no_skip_and_its_error_names_the_parameter():
    status = GradStatus()
    error = status.count_replays(_replayed(CLEAN, A_ON_ONE_RANK_AND_NONFINITE, NONFINITE))
    assert isinstance(error, RuntimeError) and "['a'] had a grad on some ranks but not on others" in str(error)
    assert status.skipped_steps == 1


def test_the_first_replay_with_an_error_is_the_one_reported():
    first = [2, 2, 0, 0, 0, 0, 0, 0, 1, 0]  # a rank's own problem
    error = GradStatus().count_replays(_replayed(first, A_ON_ONE_RANK))
    assert isinstance(error, ValueError) and "1 rank(s) found an invalid gradient" in str(error)


def test_a_tally_read_starts_again_from_zero():
    tally = _replayed(NONFINITE, A_ON_ONE_RANK)
    assert tally.take()[:2] == (1, 1)
    tally.add_(torch.tensor(CLEAN, dtype=STATUS_DTYPE))
    assert tally.take()[:2] == (0, 0)


def test_a_replay_with_non_finite_grads_on_two_ranks_is_one_skipped_step():
    # The status sums over ranks: both ranks found a non-finite grad (issue 59, item 7).
    both = [2, 2, 0, 0, 0, 0, 0, 0, 0, 2]
    status = GradStatus()
    assert status.count_replays(_replayed(both, CLEAN, both)) is None
    assert status.skipped_steps == 2
