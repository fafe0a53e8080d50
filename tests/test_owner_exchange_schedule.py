"""The batch schedule written once in ``dmuon.plan.batch_schedule`` is the order a real
step on 2 gloo ranks starts and waits for its collectives (the memory and time models
read the same schedule: tests/test_plan.py, tests/test_cost_model.py)."""

from __future__ import annotations

import pytest

from dmuon.plan import FINISH_GATHER, FINISH_SCATTER, START_GATHER, START_SCATTER, batch_schedule, make_owner_plan
from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

STARTS = {FINISH_GATHER: START_GATHER, FINISH_SCATTER: START_SCATTER}


def collectives_of(schedule: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
    """The schedule's collective events as the recorder sees them: ``("start", k)`` for
    the k-th collective started, ``("wait", k)`` for finishing it."""
    index: dict[tuple[str, int], int] = {}
    expected = []
    for event, b in schedule:
        if event in (START_GATHER, START_SCATTER):
            index[(event, b)] = len(index)
            expected.append(("start", index[(event, b)]))
        elif event in STARTS:
            expected.append(("wait", index[(STARTS[event], b)]))
    return expected


def test_a_real_step_starts_and_waits_for_its_collectives_in_the_batch_schedules_order():
    plan = make_owner_plan(scenarios.SCHEDULE_SHAPES, 2, scenarios.SCHEDULE_BATCH_NUMEL)
    assert len(plan.batches) == 3  # enough for a batch with collectives in flight on both sides
    expected = collectives_of(batch_schedule(len(plan.batches)))
    assert run_on_ranks(scenarios.owner_exchange_collectives, 2, timeout=120) == [expected, expected]
