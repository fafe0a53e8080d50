"""Host agreements (``dmuon.exchange.groups``: QK-clip's one-time check of which
attentions report) as they run under NCCL alone: on gloo groups DMuon makes for the rank
sets, not on the default group; and the grads' status, which needs neither. Here the
default group is gloo too, and ``takes_cpu_tensors`` is made to answer False, so the
groups DMuon would make next to an NCCL default group are made and used for real.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank


def _as_under_nccl_alone() -> None:
    from dmuon.exchange import groups

    groups.takes_cpu_tensors = lambda group: False


def host_sums_on_made_groups() -> dict:
    from dmuon.exchange import groups

    _as_under_nccl_alone()
    rank = dist.get_rank()
    pair = (0, 1) if rank < 2 else (2, 3)
    seen = {}
    for ranks in (pair, (0, 1, 2, 3)):  # every member asks in the same order, as DMuon's step does
        group = groups.host_group_of(ranks)
        again = groups.host_group_of(ranks)
        seen[ranks] = {"sums": groups.sum_on_host([rank, 1], group), "backend": dist.get_backend(group),
                       "ranks": dist.get_process_group_ranks(group), "made_once": again is group,
                       "own_group": group is not dist.group.WORLD}
    return {"pair": seen[pair], "world": seen[(0, 1, 2, 3)]}


def robustness_counting_host_work() -> dict:
    """The robustness scenario under NCCL alone, counting the process groups DMuon makes
    and the host sums it runs (``dmuon.exchange.groups``): the grads' status travels on the
    device, so both stay 0 whatever the grads."""
    from dmuon.exchange import groups

    _as_under_nccl_alone()
    counts = {"groups_made": 0, "host_sums": 0}
    real_new_group, real_sum = dist.new_group, groups.sum_on_host

    def new_group(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - dist.new_group's signature
        counts["groups_made"] += 1
        return real_new_group(*args, **kwargs)

    def sum_on_host(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counts["host_sums"] += 1
        return real_sum(*args, **kwargs)

    dist.new_group, groups.sum_on_host = new_group, sum_on_host
    try:
        return scenarios.robustness() | counts
    finally:
        dist.new_group, groups.sum_on_host = real_new_group, real_sum


def test_host_sums_run_on_gloo_groups_made_once_per_rank_set():
    results = run_on_ranks(host_sums_on_made_groups, 4, timeout=120)
    for rank, result in enumerate(results):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert result["pair"] == {"sums": [sum(pair), 2], "backend": "gloo", "ranks": pair, "made_once": True,
                                  "own_group": True}
        assert result["world"] == {"sums": [6, 4], "backend": "gloo", "ranks": [0, 1, 2, 3], "made_once": True,
                                   "own_group": True}


def test_missing_and_invalid_grads_need_no_host_sum_and_no_group_under_nccl_alone():
    """Missing, disagreeing and invalid grads end alike on every rank under NCCL alone,
    with no host collective and no process group made by DMuon, in any step."""
    ranks = run_on_ranks(robustness_counting_host_work, 2, timeout=120)
    for rank in ranks:
        assert (rank["groups_made"], rank["host_sums"]) == (0, 0)
        assert rank["disagree_error"].startswith("RuntimeError: DMuon: ranks disagree")
        assert rank["none_everywhere_unchanged"] and rank["nan_error"] is None
    for rank in ranks:
        assert rank["invalid_error"].startswith("ValueError: DMuon: 1 rank(s) found an invalid gradient")
    assert [rank["usable_after_errors"] for rank in ranks] == [True, True]
