"""A simple time model of the fast path, from its plan alone (no processes, no GPU).

- Newton-Schulz of batch ``b`` takes ``NS_b = max_r flops(r, b) / (peak * ns_mfu)``, with
  the peak of the dtype it multiplies in (``ns_dtype``);
- its gather and scatter take ``G_b``, ``S_b``: the slowest rank's bytes to other ranks
  over the per-rank link bandwidth (bytes to another replica over ``replica_link_gbps``);
- the step runs ``dmuon.plan.batch_schedule``: batch ``b``'s Newton-Schulz overlaps
  gather ``b + 1`` and scatter ``b - 1``, so
  ``optimizer_ms = G_0 + sum_b max(NS_b, G_{b+1} + S_{b-1}) + S_last``
  (:func:`overlapped_ms` reads it from that schedule).

Left out: the elementwise momentum and update (memory-bound, a few ms at most),
collective latency, and Newton-Schulz kernels running below ``ns_mfu`` on small
matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dmuon.plan.batches import DEFAULT_BATCH_NUMEL
from dmuon.plan.owner_plan import WIRE_BYTES, OwnerPlan, make_owner_plan
from dmuon.plan.schedule import (FINISH_GATHER, FINISH_SCATTER, NEWTON_SCHULZ, START_GATHER, START_SCATTER,
                                 batch_schedule)
from dmuon.plan.units import ParamSpec, Unit, owned_costs

H100_BF16_DENSE_TFLOPS = 989.0
# fp32 without TF32 (torch's default for fp32 matmuls), H100 SXM.
H100_FP32_DENSE_TFLOPS = 67.0


@dataclass(frozen=True)
class CostModel:
    peak_tflops: float = H100_BF16_DENSE_TFLOPS
    """Dense bf16 peak of one GPU, TFLOP/s (H100 SXM: 989)."""
    fp32_peak_tflops: float = H100_FP32_DENSE_TFLOPS
    """Dense fp32 peak of one GPU without TF32, TFLOP/s (H100 SXM: 67)."""
    ns_dtype: torch.dtype = torch.bfloat16
    """What Newton-Schulz multiplies in (DMuon's ns_dtype, resolved): picks its peak."""
    ns_mfu: float = 0.6
    """Fraction of peak Newton-Schulz's matmuls reach."""
    link_gbps: float = 400.0
    """Per-rank network bandwidth inside a replica, Gbit/s (one 400G NIC per GPU)."""
    replica_link_gbps: float = 400.0
    """Per-rank bandwidth to ranks of other replicas, Gbit/s (lower where replicas
    sit behind a slower tier of the network)."""
    tokens_per_rank: int = 8192
    """Tokens each rank processes per training step."""
    train_mfu: float = 0.4
    """Model FLOPs utilization of forward and backward."""


def exchange_ms(plan: OwnerPlan, cost: CostModel) -> tuple[list[float], list[float]]:
    """Per batch: the slowest rank's gather and scatter time, from every rank's bytes inside
    and across replicas, without any rank's splits: summed per kind of unit (``Unit.kind``:
    held alike), O(P) per kind and O(1) per unit, not O(P) per unit and rank."""
    # Each plan rank's replica (from the first parameter replicated over some mesh dims): ranks in
    # different replicas talk over ``replica_link_gbps``.
    keys: list[object] = [() for _ in range(plan.world_size)]
    for spec in plan.params:
        layout = spec.layout_on(plan.world_size)
        if layout.has_replicas:
            for rank, key in layout.replica().items():
                keys[rank] = key
            break
    near = cost.link_gbps * 1e9 / 8 / 1e3  # bytes per ms
    far = cost.replica_link_gbps * 1e9 / 8 / 1e3

    def slowest(inside: list[int], across: list[int]) -> float:
        return max(WIRE_BYTES * (i / near + a / far) for i, a in zip(inside, across))

    gather, scatter = [], []
    for batch in plan.batches:
        sent = [[0] * plan.world_size for _ in range(4)]  # gather inside, across; scatter inside, across
        alike: dict[tuple, list[Unit]] = {}
        for i in plan.travelling(batch):
            alike.setdefault(plan.units[i].kind, []).append(plan.units[i])
        for units in alike.values():
            holders = list(units[0].holder_numels())
            # Gather: source ``s`` sends its block to each owner in its own replica of the parameter
            # (that owner's sources), but not to itself.
            layout = units[0].boxes.layout
            owners: dict[tuple, int] = {}  # (owner's replica of the parameter, owner's key) -> units
            replicas: dict[object, int] = {}  # owner's replica of the parameter -> units
            own: dict[int, int] = {}  # rank -> units it owns
            for unit in units:
                replica = layout.replica_of(unit.owner)
                owners[(replica, keys[unit.owner])] = owners.get((replica, keys[unit.owner]), 0) + 1
                replicas[replica] = replicas.get(replica, 0) + 1
                own[unit.owner] = own.get(unit.owner, 0) + 1
            for source, numel in holders:
                replica = layout.replica_of(source)
                same = owners.get((replica, keys[source]), 0)
                sent[0][source] += numel * (same - own.get(source, 0))
                sent[1][source] += numel * (replicas.get(replica, 0) - same)
            # Scatter: the owners send every holder's block back, but their own.
            by_key: dict[object, int] = {}
            for holder, numel in holders:
                by_key[keys[holder]] = by_key.get(keys[holder], 0) + numel
            total = sum(by_key.values())
            for unit in units:
                near_numel = by_key.get(keys[unit.owner], 0)
                sent[2][unit.owner] += near_numel - unit.block_numel(unit.owner)
                sent[3][unit.owner] += total - near_numel
        gather.append(slowest(sent[0], sent[1]))
        scatter.append(slowest(sent[2], sent[3]))
    return gather, scatter


def newton_schulz_ms(plan: OwnerPlan, cost: CostModel) -> list[float]:
    """Per batch: the slowest rank's Newton-Schulz time."""
    peak_tflops = cost.fp32_peak_tflops if cost.ns_dtype == torch.float32 else cost.peak_tflops
    flops_per_ms = peak_tflops * 1e9 * cost.ns_mfu
    return [max(owned_costs(plan.units, b, plan.world_size)) / flops_per_ms for b in plan.batches]


def overlapped_ms(ns: list[float], gather: list[float], scatter: list[float]) -> float:
    """The step's time under :func:`dmuon.plan.batch_schedule` (module docstring): each
    Newton-Schulz takes as long as it or the collectives in flight across it, whichever is
    longer, and a collective in flight across none adds its own time."""
    durations = {START_GATHER: gather, START_SCATTER: scatter}
    started: dict[tuple[str, int], int] = {}  # collective -> Newton-Schulz runs done when it started
    hidden = [0.0] * len(ns)
    exposed = 0.0
    done = 0
    for event, b in batch_schedule(len(ns)):
        if event == NEWTON_SCHULZ:
            done += 1
        elif event in durations:
            started[(event, b)] = done
        elif event in (FINISH_GATHER, FINISH_SCATTER):
            start = START_GATHER if event == FINISH_GATHER else START_SCATTER
            ms = durations[start][b]
            first = started.pop((start, b))
            if first < done:  # in flight across Newton-Schulz `first`: hidden behind it
                hidden[first] += ms
            else:
                exposed += ms
    return exposed + sum(max(ns_ms, comm_ms) for ns_ms, comm_ms in zip(ns, hidden))


def optimizer_ms(plan: OwnerPlan, cost: CostModel) -> float:
    """The predicted time of the fast path's step."""
    return overlapped_ms(newton_schulz_ms(plan, cost), *exchange_ms(plan, cost))


def plan_with_best_split(specs: Sequence[ParamSpec], world_size: int, max_batch_numel: int = DEFAULT_BATCH_NUMEL,
                         cost: CostModel = CostModel()) -> tuple[OwnerPlan, bool]:
    """The owner plan with Newton-Schulz spread over all replicas or kept inside each,
    whichever is predicted faster (ties keep the replicas apart: less traffic), and
    that choice. Without replicated parameters the choice changes nothing: one plan,
    and False."""
    if not any(spec.layout_on(world_size).has_replicas for spec in specs):
        return make_owner_plan(specs, world_size, max_batch_numel, False), False
    split = make_owner_plan(specs, world_size, max_batch_numel, True)
    apart = make_owner_plan(specs, world_size, max_batch_numel, False)
    pays = optimizer_ms(split, cost) < optimizer_ms(apart, cost)
    return (split if pays else apart), pays
