"""DMuon next to TorchTitan 0.3.0's DistMuon: computed from shapes alone (no processes,
no GPU), bytes and balance, and a training step's bytes with DMuon against AdamW; or,
with ``--time``, measured on CPU ranks. Every figure of docs/vs_distmuon.md comes from
this module::

    python -m benchmarks.vs_distmuon            # the two computed tables, in Markdown
    python -m benchmarks.vs_distmuon --json     # the same rows as JSON
    python -m benchmarks.vs_distmuon --time     # measured (TorchTitan 0.3 environment)

The setting is TorchTitan's llama3 8B and 70B with FSDP2 ``Shard(0)`` over P ranks
(``data_parallel_shard_degree`` P, no TP/PP/HSDP), fp32 parameters (TorchTitan's
default ``training.dtype``), bf16 mixed-precision all-gathers and fp32 gradient
reduce-scatters (TorchTitan 0.2.2's ``mixed_precision_param`` / ``mixed_precision_reduce``
defaults). The Muon matrices are each block's wq wk wv wo w1 w2 w3; embeddings, output
head and norms go to AdamW (both optimizers route them so).

DMuon's figures are its own planner's (``dmuon.plan.make_owner_plan``, what the
optimizer runs, as ``dmuon.tools.plan_report`` does); DistMuon's come from the model of its
planner in ``benchmarks.distmuon_model``. Byte counts are per rank per step, bytes
sent plus bytes received; under FSDP ``Shard(0)`` every rank receives exactly what it
sends in both exchanges, so sent = received = half of each figure.

``--time`` measures instead (``benchmarks.vs_distmuon_time``): DMuon and DistMuon
stepping the same FSDP2 stack on CPU ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from benchmarks.distmuon_model import (
    BUCKETINGS,
    PARAM_BYTES,
    bucket_pipeline_flops,
    buckets_for,
    distmuon_owners,
    ns_loads,
    whole_matrix_exchange_bytes,
)
from benchmarks import vs_distmuon_time
from benchmarks.vs_distmuon_tables import compare_table, step_table
from dmuon.tools import (AUTO, DEFAULT_NS_ALGORITHM, Llama3, LLAMA3_SHAPES as PRESETS, make_owner_plan,
                         min_bytes_per_rank, newton_schulz_flops, OwnerPlan, ParamSpec, WIRE_BYTES)

COMPARE_MODELS = ("llama3-8b", "llama3-70b")
COMPARE_WORLD_SIZES = (8, 64)
STEP_WORLD_SIZES = (8, 16, 64, 256, 1024)
PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
FP32, BF16 = 4, 2
ALLGATHER_BYTES = BF16  # mixed_precision_param = "bfloat16"
REDUCE_BYTES = FP32  # mixed_precision_reduce = "float32" (its only choice in 0.2.2)


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


# ---------------------------------------------------------------- the command

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_distmuon", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(PRESETS), default=list(COMPARE_MODELS))
    parser.add_argument("--compare-world-size", type=int, nargs="+", default=list(COMPARE_WORLD_SIZES))
    parser.add_argument("--step-world-size", type=int, nargs="+", default=list(STEP_WORLD_SIZES))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    vs_distmuon_time.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.time:
        vs_distmuon_time.main_timed(args, argv)
        return
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
    print("\nDMuon's bytes over the owner-exchange minimum (2 x dmuon.tools.plan_report.min_bytes_per_rank): "
          + ", ".join(f"{row['model']} P={row['world_size']}: {row['dmuon']['bytes_per_rank_max'] / row['dmuon_minimum']:.3f}"
                      for row in compared))
    print("\nA training step's bytes per rank (sent + received, one micro-batch; GB = 1e9 bytes):\n")
    print(step_table(steps))


if __name__ == "__main__":
    main()
