"""The fast path's time model (dmuon.plan.cost_model): what it charges and what it chooses."""

from __future__ import annotations

import random

import pytest

from dmuon.plan import ParamSpec, make_owner_plan
from dmuon.plan.cost_model import CostModel, exchange_ms, optimizer_ms, overlapped_ms, plan_with_best_split
from dmuon.plan.layout import Layout

pytestmark = pytest.mark.unit

HSDP_SPECS = [ParamSpec((512, 512), layout=Layout.hsdp(2, 2)) for _ in range(8)]


def test_bytes_to_another_replica_are_charged_at_the_replica_link():
    plan = make_owner_plan(HSDP_SPECS, 4, split_replicas=True)
    fast = sum(sum(part) for part in exchange_ms(plan, CostModel()))
    slow = sum(sum(part) for part in exchange_ms(plan, CostModel(replica_link_gbps=40.0)))
    assert slow > 5 * fast


def _splits(specs, world_size: int, cost: CostModel = CostModel()) -> bool:
    """Whether the cost model chooses to spread Newton-Schulz over all replicas."""
    return plan_with_best_split(specs, world_size, cost=cost)[1]


def test_splitting_pays_when_links_between_replicas_are_fast():
    assert _splits(HSDP_SPECS, 4, cost=CostModel(ns_mfu=0.001))


def test_keeping_replicas_apart_pays_when_their_links_are_slow():
    assert not _splits(HSDP_SPECS, 4, cost=CostModel(replica_link_gbps=0.001))


def test_without_replicas_the_choice_is_moot_and_answered_no():
    assert not _splits([ParamSpec((64, 64))] * 4, 4)


def test_the_predicted_step_is_at_least_its_newton_schulz():
    plan = make_owner_plan(HSDP_SPECS, 4)
    flops = max(plan.ns_flops(r) for r in range(4))
    cost = CostModel()
    assert optimizer_ms(plan, cost) >= flops / (cost.peak_tflops * 1e9 * cost.ns_mfu)


def test_newton_schulz_in_float32_is_charged_at_the_fp32_peak():
    import torch

    from dmuon.plan.cost_model import newton_schulz_ms

    plan = make_owner_plan([ParamSpec((512, 512)) for _ in range(4)], 2)
    bf16 = sum(newton_schulz_ms(plan, CostModel()))
    fp32 = sum(newton_schulz_ms(plan, CostModel(ns_dtype=torch.float32)))
    assert fp32 == pytest.approx(bf16 * CostModel().peak_tflops / CostModel().fp32_peak_tflops)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
def test_the_time_model_read_from_the_schedule_is_g0_plus_the_overlapped_batches_plus_s_last(n):
    rng = random.Random(n)
    ns, gather, scatter = ([rng.random() for _ in range(n)] for _ in range(3))
    closed_form = 0.0 if not n else gather[0] + scatter[-1] + sum(
        max(ns[b], (gather[b + 1] if b + 1 < n else 0.0) + (scatter[b - 1] if b else 0.0)) for b in range(n))
    assert overlapped_ms(ns, gather, scatter) == pytest.approx(closed_form)


def test_communication_hidden_behind_newton_schulz_costs_nothing():
    assert overlapped_ms([10.0, 10.0, 10.0], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == 1.0 + 30.0 + 6.0
