"""A model of TorchTitan 0.3.0's DistMuon planner, for the computed rows of
``python -m benchmarks.vs_distmuon``: which rank owns each matrix, the bytes of its
whole-matrix exchange, and when the last rank finishes Newton-Schulz.

Written from reading ``torchtitan/distributed/flex_shard/dist_muon.py``
(``_resolve_muon_redistribution_plans``, ``_assign_balanced_owner_ranks``,
``_estimate_muon_compute_cost``, ``_balance_loads_across_partitions``) and
``_optimizer_reshard_schedule.py`` (``_build_bucket_plans`` sorts each bucket by FQN;
``_resolve_routes_to_transfers``: a holder never sends to itself), not copied;
``tests/test_vs_distmuon.py`` checks it against TorchTitan's own balancing function, and
``tests/test_titan03_vs_distmuon_time.py`` its bytes against DistMuon's measured ones.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from dmuon.tools import chunk_ranges, DEFAULT_NS_STEPS, newton_schulz_flops

PARAM_BYTES = 4  # fp32, what TorchTitan stores: DistMuon's exchange dtype (storage dtype)
BUCKETINGS = ("per_layer", "one_bucket")


def distmuon_cost(shape: Sequence[int], ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """DistMuon's balancing key for one 2-D matrix: ``ns_steps * s^2 (2 l + s)`` with
    ``s <= l`` its sides (multiply-adds; half of ``newton_schulz_flops``)."""
    s, l = sorted(shape)
    return ns_steps * s * s * (2 * l + s)


def buckets_for(names: Sequence[str], bucketing: str) -> list[list[int]]:
    """Indices of ``names`` in each bucket, in bucket order: ``"per_layer"`` is one
    ``BucketConfig`` per transformer block in layer order (the shape of TorchTitan's
    Kimi recipe, ``models/kimi_k2_7/config_registry.py``); ``"one_bucket"`` is one for all."""
    if bucketing == "one_bucket":
        return [list(range(len(names)))]
    if bucketing != "per_layer":
        raise ValueError(f"unknown bucketing {bucketing!r}")
    by_layer: dict[int, list[int]] = {}
    for index, name in enumerate(names):
        by_layer.setdefault(int(name.split(".")[1]), []).append(index)
    return [by_layer[layer] for layer in sorted(by_layer)]


def distmuon_owners(matrices: Sequence[tuple[str, Sequence[int]]], world_size: int, bucketing: str = "per_layer",
                    element_size: int = PARAM_BYTES, ns_steps: int = DEFAULT_NS_STEPS) -> list[int]:
    """The owner (rank of the 1-D ``dp_shard`` mesh) DistMuon gives each ``Owned``
    matrix, as its code chooses it:

    - buckets are planned in order; inside a bucket the items are sorted by FQN;
    - each bucket is an LPT: items by (cost desc, bytes desc, FQN asc); each goes to the
      rank smallest in (this bucket's cost, this bucket's bytes, cumulative cost over
      earlier buckets, rank): the load of the bucket first, the step's load only to
      break ties;
    - the cumulative cost is carried from bucket to bucket (same participants).
    """
    owners = [0] * len(matrices)
    cumulative = [0] * world_size
    for bucket in buckets_for([name for name, _ in matrices], bucketing):
        items = sorted(bucket, key=lambda i: matrices[i][0])
        heap = [(0, 0, cumulative[rank], rank) for rank in range(world_size)]
        heapq.heapify(heap)
        keyed = [(distmuon_cost(matrices[i][1], ns_steps), math.prod(matrices[i][1]) * element_size, matrices[i][0], i)
                 for i in items]
        for cost, size, _name, index in sorted(keyed, key=lambda k: (-k[0], -k[1], k[2])):
            load, load_bytes, total, rank = heapq.heappop(heap)
            owners[index] = rank
            heapq.heappush(heap, (load + cost, load_bytes + size, total + cost, rank))
        for _load, _bytes, total, rank in heap:
            cumulative[rank] = total
    return owners


def whole_matrix_exchange_bytes(shapes: Sequence[Sequence[int]], owners: Sequence[int], world_size: int,
                                element_size: int) -> tuple[list[int], list[int]]:
    """Per rank (sent, received) bytes of a whole-matrix owner exchange of row-sharded
    matrices (torch's ``Shard(0)`` chunks): every other holder sends its block to the
    owner, the owner sends each one its block of the result."""
    sent = [0] * world_size
    received = [0] * world_size
    for shape, owner in zip(shapes, owners):
        cols = math.prod(shape[1:])
        for rank, (_start, rows) in enumerate(chunk_ranges(shape[0], world_size)):
            if rank == owner or not rows:
                continue
            block = rows * cols * element_size
            sent[rank] += block  # gather: to the owner
            received[owner] += block
            sent[owner] += block  # scatter: the result back
            received[rank] += block
    return sent, received


def ns_loads(shapes: Sequence[Sequence[int]], owners: Sequence[int], world_size: int,
             ns_steps: int = DEFAULT_NS_STEPS) -> list[int]:
    """Newton-Schulz flops per rank (``dmuon.numerics.newton_schulz.newton_schulz_flops``)."""
    loads = [0] * world_size
    for shape, owner in zip(shapes, owners):
        loads[owner] += newton_schulz_flops(shape, ns_steps)
    return loads


def bucket_pipeline_flops(shapes: Sequence[Sequence[int]], owners: Sequence[int], world_size: int,
                          buckets: Sequence[Sequence[int]], ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """When the last rank finishes Newton-Schulz, in flops, with DistMuon's bucket
    pipeline and communication taken as free (``_BucketedRedistributionRuntime.run`` in
    ``_optimizer_reshard_runtime.py``): a rank runs its buckets in order; bucket k + 1's
    inputs arrive by an ``all_to_all`` queued on the transfer stream behind bucket
    k - 1's return ``all_to_all``, which waits for every rank to finish bucket k - 1. So
    ``F(k + 1, r) = max(F(k, r), max_r' F(k - 1, r')) + load(k + 1, r)``."""
    before_last = [0] * world_size  # F(k - 1, .)
    last = [0] * world_size  # F(k, .)
    for bucket in buckets:
        loads = [0] * world_size
        for i in bucket:
            loads[owners[i]] += newton_schulz_flops(shapes[i], ns_steps)
        barrier = max(before_last)
        before_last, last = last, [max(last[r], barrier) + loads[r] for r in range(world_size)]
    return max(last)
