"""DMuon next to TorchTitan 0.3.0's DistMuon, and a training step's bytes with DMuon
against AdamW, from shapes alone (no processes, no GPU). Every figure of
docs/vs_distmuon.md comes from this module::

    python -m benchmarks.vs_distmuon            # the two tables, in Markdown
    python -m benchmarks.vs_distmuon --json     # the same rows as JSON

The setting is TorchTitan's llama3 8B and 70B with FSDP2 ``Shard(0)`` over P ranks
(``data_parallel_shard_degree`` P, no TP/PP/HSDP), fp32 parameters (TorchTitan's
default ``training.dtype``), bf16 mixed-precision all-gathers and fp32 gradient
reduce-scatters (TorchTitan 0.2.2's ``mixed_precision_param`` / ``mixed_precision_reduce``
defaults). The Muon matrices are each block's wq wk wv wo w1 w2 w3; embeddings, output
head and norms go to AdamW (both optimizers route them so).

DMuon's figures are its own planner's (``dmuon.plan.make_owner_plan``, what the
optimizer runs, as ``dmuon.plan_report`` does). DistMuon's owner choice is modelled by
:func:`distmuon_owners`, written from reading
``torchtitan/distributed/flex_shard/dist_muon.py`` (``_resolve_muon_redistribution_plans``,
``_assign_balanced_owner_ranks``, ``_estimate_muon_compute_cost``,
``_balance_loads_across_partitions``) and ``_optimizer_reshard_schedule.py``
(``_build_bucket_plans`` sorts each bucket by FQN; ``_resolve_routes_to_transfers``: a
holder never sends to itself), not copied. Byte counts are per rank per step, bytes
sent plus bytes received; under FSDP ``Shard(0)`` every rank receives exactly what it
sends in both exchanges, so sent = received = half of each figure.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dmuon.numerics.newton_schulz import AUTO, DEFAULT_NS_ALGORITHM, DEFAULT_NS_STEPS, newton_schulz_flops
from dmuon.plan import WIRE_BYTES, OwnerPlan, ParamSpec, make_owner_plan
from dmuon.plan.layout import chunk_ranges
from dmuon.plan_report import PRESETS, Llama3, min_bytes_per_rank

COMPARE_MODELS = ("llama3-8b", "llama3-70b")
COMPARE_WORLD_SIZES = (8, 64)
STEP_WORLD_SIZES = (8, 16, 64, 256, 1024)
PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
FP32, BF16 = 4, 2
PARAM_BYTES = FP32  # what TorchTitan stores: DistMuon's exchange dtype (storage dtype)
ALLGATHER_BYTES = BF16  # mixed_precision_param = "bfloat16"
REDUCE_BYTES = FP32  # mixed_precision_reduce = "float32" (its only choice in 0.2.2)
BUCKETINGS = ("per_layer", "one_bucket")


# ---------------------------------------------------------------- the model's tensors

def muon_matrices(model: Llama3) -> list[tuple[str, tuple[int, int]]]:
    """(FQN, shape) of every Muon matrix, TorchTitan's names, in model order."""
    shapes = model.matrices()
    per_layer = len(PROJECTIONS)
    return [(f"layers.{i // per_layer}.{PROJECTIONS[i % per_layer]}.weight", shape) for i, shape in enumerate(shapes)]


def all_parameters(model: Llama3) -> list[tuple[str, tuple[int, ...], bool]]:
    """(FQN, shape, resharded after forward) of every parameter, grouped as TorchTitan
    0.2.2's llama3 ``apply_fsdp`` wraps them: the embedding and each block reshard
    after forward (so backward all-gathers them again); ``[norm, output]`` do not."""
    d, v = model.dim, model.vocab
    params: list[tuple[str, tuple[int, ...], bool]] = [("tok_embeddings.weight", (v, d), True)]
    for layer in range(model.layers):
        params += [(f"layers.{layer}.attention_norm.weight", (d,), True), (f"layers.{layer}.ffn_norm.weight", (d,), True)]
    params += [(name, shape, True) for name, shape in muon_matrices(model)]
    params += [("norm.weight", (d,), False), ("output.weight", (v, d), False)]
    assert sum(math.prod(s) for _, s, _ in params) == model.params()
    return params


# ---------------------------------------------------------------- DistMuon, modelled

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


# ---------------------------------------------------------------- DMuon, its own plan

def dmuon_plan(model: Llama3, world_size: int, ns_algorithm: str = DEFAULT_NS_ALGORITHM) -> OwnerPlan:
    """The owner plan DMuon runs for the model's Muon matrices under FSDP ``Shard(0)``,
    each matrix costing the flops of ``ns_algorithm``."""
    return make_owner_plan([ParamSpec(shape, ns_algorithm=ns_algorithm) for shape in model.matrices()], world_size)


def dmuon_bytes(plan: OwnerPlan) -> tuple[list[int], list[int]]:
    """Per rank (sent, received) bytes of DMuon's owner exchange (bf16): sent is
    ``OwnerPlan.bytes_sent``; received reads the same splits from the other side."""
    sent = [plan.bytes_sent(rank) for rank in range(plan.world_size)]
    received = []
    for rank in range(plan.world_size):
        elements = 0
        for batch in plan.batches:
            for _send, recv in (plan.gather_splits(batch, rank), plan.scatter_splits(batch, rank)):
                elements += sum(recv) - recv[rank]
        received.append(elements * WIRE_BYTES)
    return sent, received


# ---------------------------------------------------------------- table 1: vs DistMuon

@dataclass(frozen=True)
class Exchange:
    """One optimizer's exchange and Newton-Schulz balance at one (model, P)."""

    bytes_per_rank_max: int
    """The most bytes (sent + received) any rank moves in one step."""
    ns_max_over_mean: float
    """The busiest rank's Newton-Schulz flops over the mean."""
    ns_critical_over_mean: float | None = None
    """The last rank's finish over the mean, communication taken as free: DMuon's
    ``ns_critical_path_flops`` (the sum over batches of the busiest rank's flops);
    DistMuon's :func:`bucket_pipeline_flops`."""


def compare(model_name: str, world_size: int) -> dict:
    """DistMuon (whole matrices owned, storage dtype, per-layer or one bucket) and DMuon
    (its plan, bf16) on the same shapes."""
    model = PRESETS[model_name]
    matrices = muon_matrices(model)
    shapes = [shape for _, shape in matrices]
    total_flops = sum(newton_schulz_flops(s) for s in shapes)
    mean = total_flops / world_size
    muon_elements = sum(math.prod(s) for s in shapes)
    row: dict = {"model": model_name, "world_size": world_size, "matrices": len(shapes),
                 "muon_elements": muon_elements}
    for bucketing in BUCKETINGS:
        owners = distmuon_owners(matrices, world_size, bucketing)
        sent, received = whole_matrix_exchange_bytes(shapes, owners, world_size, PARAM_BYTES)
        loads = ns_loads(shapes, owners, world_size)
        pipeline = bucket_pipeline_flops(shapes, owners, world_size, buckets_for([n for n, _ in matrices], bucketing))
        row[f"distmuon_{bucketing}"] = Exchange(max(s + r for s, r in zip(sent, received)), max(loads) / mean,
                                                pipeline / mean).__dict__
    # DMuon as it runs by default, and with ns_algorithm="auto" (Gram Newton-Schulz where it
    # costs fewer flops): its flops over the same standard mean, so below 1 is time saved.
    for key, algorithm in (("dmuon", DEFAULT_NS_ALGORITHM), ("dmuon_gram", AUTO)):
        plan = dmuon_plan(model, world_size, algorithm)
        sent, received = dmuon_bytes(plan)
        row[key] = Exchange(max(s + r for s, r in zip(sent, received)),
                            max(plan.ns_flops(r) for r in range(world_size)) / mean,
                            plan.ns_critical_path_flops / mean).__dict__
        if key == "dmuon":
            row["dmuon_sent_max"], row["plan"] = max(sent), plan
    # The owner exchange's floor, both directions: min_bytes_per_rank counts bytes sent (bf16).
    row["dmuon_minimum"] = 2 * min_bytes_per_rank("fsdp", (world_size,), muon_elements, True)
    return row


# ---------------------------------------------------------------- table 2: a training step

def fsdp_step_bytes(model: Llama3, world_size: int) -> dict[str, int]:
    """FSDP2's bytes per rank (sent + received) in one training step with one
    micro-batch: ring collectives, each rank sending and receiving ``P - 1`` shards;
    FSDP2 pads dim 0 to a multiple of P, so a shard is ``ceil(rows / P)`` rows."""
    forward = backward = reduce = 0
    for _name, shape, reshards in all_parameters(model):
        shard = math.ceil(shape[0] / world_size) * math.prod(shape[1:])
        moved = 2 * (world_size - 1) * shard  # sent + received
        forward += moved * ALLGATHER_BYTES
        backward += moved * ALLGATHER_BYTES if reshards else 0
        reduce += moved * REDUCE_BYTES
    return {"all_gather_forward": forward, "all_gather_backward": backward, "reduce_scatter": reduce}


def step_bytes(model_name: str, world_size: int, plan: OwnerPlan | None = None) -> dict:
    """A training step's bytes per rank with AdamW and with DMuon, and the form of
    Moonlight's extra term (a bf16 all-gather of every Muon matrix to every rank)."""
    model = PRESETS[model_name]
    plan = plan if plan is not None else dmuon_plan(model, world_size)
    fsdp = fsdp_step_bytes(model, world_size)
    adamw = sum(fsdp.values())
    sent, received = dmuon_bytes(plan)
    exchange = max(s + r for s, r in zip(sent, received))
    muon_shards = sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in model.matrices())
    all_gather_all = 2 * (world_size - 1) * muon_shards * BF16
    return {"model": model_name, "world_size": world_size, **fsdp, "adamw_step": adamw,
            "dmuon_exchange": exchange, "dmuon_step": adamw + exchange, "ratio": (adamw + exchange) / adamw,
            "allgather_muon_ratio": (adamw + all_gather_all) / adamw}


# ---------------------------------------------------------------- output

def _gb(n: int) -> str:
    return f"{n / 1e9:.3f}"


def compare_table(rows: list[dict]) -> str:
    lines = [
        "| model | P | optimizer | exchange dtype | GB/rank | vs DMuon | NS max/mean | NS critical path/mean |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    labels = (("distmuon_per_layer", "DistMuon, a bucket per block", "fp32 (storage)"),
              ("distmuon_one_bucket", "DistMuon, one bucket", "fp32 (storage)"),
              ("dmuon", "DMuon", "bf16"),
              ("dmuon_gram", "DMuon, ns_algorithm=auto (Gram)", "bf16"))
    for row in rows:
        ours = row["dmuon"]["bytes_per_rank_max"]
        for key, label, dtype in labels:
            figures = row[key]
            lines.append(
                f"| {row['model']} | {row['world_size']} | {label} | {dtype} | {_gb(figures['bytes_per_rank_max'])} "
                f"| {figures['bytes_per_rank_max'] / ours:.3f}x | {figures['ns_max_over_mean']:.3f} "
                f"| {figures['ns_critical_over_mean']:.3f} |")
    return "\n".join(lines)


def step_table(rows: list[dict]) -> str:
    lines = [
        "| model | P | FSDP all-gather fwd + bwd (bf16) | reduce-scatter (fp32) | AdamW step | DMuon exchange "
        "| DMuon step | DMuon / AdamW | with a bf16 all-gather of every matrix instead |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['world_size']} | {_gb(row['all_gather_forward'] + row['all_gather_backward'])} "
            f"| {_gb(row['reduce_scatter'])} | {_gb(row['adamw_step'])} | {_gb(row['dmuon_exchange'])} "
            f"| {_gb(row['dmuon_step'])} | {row['ratio']:.4f} | {row['allgather_muon_ratio']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_distmuon", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(PRESETS), default=list(COMPARE_MODELS))
    parser.add_argument("--compare-world-size", type=int, nargs="+", default=list(COMPARE_WORLD_SIZES))
    parser.add_argument("--step-world-size", type=int, nargs="+", default=list(STEP_WORLD_SIZES))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    plans: dict[tuple[str, int], OwnerPlan] = {}
    compared = []
    for name in args.models:
        for p in args.compare_world_size:
            row = compare(name, p)
            plans[name, p] = row.pop("plan")
            compared.append(row)
    steps = [step_bytes(name, p, plans.get((name, p))) for name in args.models for p in args.step_world_size]
    if args.json:
        print(json.dumps({"vs_distmuon": compared, "training_step": steps}, indent=2))
        return
    print("Optimizer exchange per rank per step (sent + received; GB = 1e9 bytes) and Newton-Schulz balance "
          "(flops over the mean of standard Newton-Schulz):\n")
    print(compare_table(compared))
    print("\nDMuon's bytes over the owner-exchange minimum (2 x dmuon.plan_report.min_bytes_per_rank): "
          + ", ".join(f"{row['model']} P={row['world_size']}: {row['dmuon']['bytes_per_rank_max'] / row['dmuon_minimum']:.3f}"
                      for row in compared))
    print("\nA training step's bytes per rank (sent + received, one micro-batch; GB = 1e9 bytes):\n")
    print(step_table(steps))


if __name__ == "__main__":
    main()
