"""The grads' status travels on the device: missing, disagreeing and invalid grads end
alike on every rank with no host agreement and no process group made by DMuon, in any
step. (On gloo the mesh's device is the CPU; what this checks is that DMuon makes no
group of its own and runs no collective outside its plan's; the dry run counts
collectives on CPU tensors under a CUDA-only default group: tests/test_dry_run_host_costs.py.)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank


def robustness_counting_groups() -> dict:
    counts = {"groups_made": 0}
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - dist.new_group's signature
        counts["groups_made"] += 1
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group
    try:
        return scenarios.robustness() | counts
    finally:
        dist.new_group = real_new_group


def test_missing_and_invalid_grads_make_no_process_group_and_end_alike_on_every_rank():
    ranks = run_on_ranks(robustness_counting_groups, 2, timeout=120)
    for rank in ranks:
        assert rank["groups_made"] == 0
        assert rank["disagree_error"].startswith("RuntimeError: DMuon: ranks disagree")
        assert rank["invalid_error"].startswith("ValueError: DMuon: 1 rank(s) found an invalid gradient")
        assert rank["none_everywhere_unchanged"] and rank["nan_error"] is None
        assert rank["usable_after_errors"]
