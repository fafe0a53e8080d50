"""What DMuon's fast path does at scale, from shapes alone (no processes, no GPU).

Run::

    python -m dmuon.tools.plan_report --model llama3-8b --world-size 8 64 256 1024
    python -m dmuon.tools.plan_report --model llama3-70b --world-size 64 --json
    python -m dmuon.tools.plan_report --shapes shapes.json --world-size 16

It builds the optimizer's own owner plan (``dmuon.plan.make_owner_plan``) for the Muon
matrices of a model, FSDP2-sharded (``Shard(0)``) over P ranks, and reports the balance
of Newton-Schulz work, the bytes each rank sends, the scratch memory, and a predicted
time from a simple cost model:

- each matrix costs the flops of ``--ns-algorithm`` (``newton_schulz_flops``; Gram
  Newton-Schulz for ``gram``, and for ``auto`` where it costs fewer), and owners
  balance those;
- Newton-Schulz of batch ``b`` takes ``NS_b = max_r flops(r, b) / (peak * ns_mfu)``, with
  the bf16 peak, or the fp32 one for ``--ns-dtype float32``;
- its gather and scatter take ``G_b``, ``S_b`` = the most bytes a rank sends in them
  divided by the per-rank link bandwidth;
- the step overlaps batch ``b``'s Newton-Schulz with gather ``b + 1`` and scatter
  ``b - 1`` (``dmuon.exchange.owner_exchange``), so
  ``optimizer_ms = G_0 + sum_b max(NS_b, G_{b+1} + S_{b-1}) + S_{last}``;
- ``train_step_ms = 6 * params * tokens_per_rank / (train_mfu * peak)`` (forward and
  backward of a dense model), and ``optimizer_fraction = optimizer / (train + optimizer)``.

Left out of the model: the elementwise momentum and update (memory-bound, about 30
bytes of HBM traffic per local element: a few ms at most), collective latency, and
Newton-Schulz kernels running below ``ns_mfu`` on small matrices.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dmuon.numerics.newton_schulz import DEFAULT_NS_ALGORITHM, DEFAULT_NS_STEPS, NS_ALGORITHMS, NS_DTYPES
from dmuon.plan.batches import DEFAULT_BATCH_NUMEL
from dmuon.plan.cost_model import CostModel, exchange_ms, newton_schulz_ms, overlapped_ms
from dmuon.plan.layout import Layout
from dmuon.plan.owner_plan import make_owner_plan
from dmuon.plan.owner_plan import lpt_bound_flops
from dmuon.plan.units import ParamSpec


@dataclass(frozen=True)
class Llama3:
    """The shapes that decide Muon's work in a llama3 model."""

    dim: int
    ffn: int
    kv: int
    layers: int
    vocab: int = 128256

    def matrices(self) -> list[tuple[int, int]]:
        """Hidden matrices per layer: wq, wk, wv, wo, w1, w2, w3 (nn.Linear: out x in)."""
        d, f, kv = self.dim, self.ffn, self.kv
        return [(d, d), (kv, d), (kv, d), (d, d), (f, d), (d, f), (f, d)] * self.layers

    def params(self) -> int:
        """All parameters: the matrices, embeddings, output head and RMSNorm weights."""
        return sum(a * b for a, b in self.matrices()) + 2 * self.vocab * self.dim + (2 * self.layers + 1) * self.dim


PRESETS = {
    "llama3-8b": Llama3(dim=4096, ffn=14336, kv=1024, layers=32),
    "llama3-70b": Llama3(dim=8192, ffn=28672, kv=1024, layers=80),
    "llama3-405b": Llama3(dim=16384, ffn=53248, kv=1024, layers=126),
}


def min_bytes_per_rank(layout: str, mesh_shape: Sequence[int], muon_elements: int, split_replicas: bool) -> int:
    """The owner exchange's minimum bytes per rank for N Muon elements in bf16: every
    matrix must reach its owner from the ranks holding it and go back to them.
    ``layout`` is one of ``benchmarks.bench``'s ``--layout`` names. Only the reports
    need this yardstick (this one's ``bytes/min`` column and the benchmark's table), so
    it lives here, outside what the optimizer imports.

    - P ranks each holding a 1/P block (``fsdp``, ``fsdp_tp``, ``tp``): the owner
      receives ``(P-1)/P`` of it and sends ``(P-1)/P`` back: ``4 N (P-1) / P^2``;
    - ``hsdp``, mesh ``(R, S)``, Newton-Schulz split over all P = R S ranks: the owner
      gathers ``(S-1)/S`` from its replica and sends a 1/S block to each of the other
      ``P - 1`` holders: ``2 N (S + P - 2) / (S P)``;
    - ``hsdp`` with replicas kept apart: FSDP inside each replica, ``4 N (S-1) / S^2``.
    """
    n = muon_elements
    if layout == "hsdp":
        replicas, shards = mesh_shape
        world = replicas * shards
        if split_replicas:
            return int(2 * n * (shards + world - 2) / (shards * world))
        return int(4 * n * (shards - 1) / shards**2)
    world = math.prod(mesh_shape)
    return int(4 * n * (world - 1) / world**2)


def report(name: str, specs: Sequence[ParamSpec], params: int, world_size: int, cost: CostModel,
           max_batch_numel: int = DEFAULT_BATCH_NUMEL, replicas: int = 1, split_replicas: bool = True) -> dict:
    """The plan's figures and predicted times, as ``--json`` prints them. With
    ``replicas`` R > 1 the matrices are HSDP-sharded (R replicas of P / R shards), and
    the row also says whether Newton-Schulz is split across replicas."""
    if replicas > 1:
        layout = Layout.hsdp(replicas, world_size // replicas)
        specs = [replace(spec, layout=layout) for spec in specs]
    plan = make_owner_plan(specs, world_size, max_batch_numel, split_replicas)
    ranks = range(world_size)
    total = sum(u.cost for u in plan.units)
    muon_elements = sum(math.prod(s.shape) for s in specs)
    critical = plan.ns_critical_path_flops
    per_rank_ideal = total / world_size
    ns = newton_schulz_ms(plan, cost)
    gather, scatter = exchange_ms(plan, cost)
    optimizer_ms = overlapped_ms(ns, gather, scatter)
    train_ms = 6 * params * cost.tokens_per_rank / (cost.train_mfu * cost.peak_tflops * 1e9)
    return {
        "model": name,
        "world_size": world_size,
        "matrices": len(plan.units),
        "muon_elements": muon_elements,
        "ns_flops_total": total,
        "ns_flops_per_rank_max": max(plan.ns_flops(r) for r in ranks),
        "ns_critical_path_flops": critical,
        "ns_efficiency": per_rank_ideal / critical if critical else 1.0,
        "lpt_bound_efficiency": per_rank_ideal / lpt_bound_flops(plan) if total else 1.0,
        "batches": len(plan.batches),
        "bytes_sent_per_rank_max": max(plan.bytes_sent(r) for r in ranks),
        "bytes_minimum": min_bytes_per_rank("hsdp", (replicas, world_size // replicas), muon_elements, split_replicas)
        if replicas > 1 else min_bytes_per_rank("fsdp", (world_size,), muon_elements, True),
        "peak_scratch_bytes_per_rank": max(plan.peak_scratch_bytes(r) for r in ranks),
        "predicted": {
            "ns_ms": sum(ns),
            "comm_ms": sum(gather) + sum(scatter),
            "optimizer_ms": optimizer_ms,
            "train_step_ms": train_ms,
            "optimizer_fraction": optimizer_ms / (train_ms + optimizer_ms),
        },
    } | ({"replicas": replicas, "split_replicas": split_replicas} if replicas > 1 else {})


def limit(row: dict) -> str:
    """What bounds a row: matrix granularity, the network, or nothing (balanced)."""
    if row["lpt_bound_efficiency"] < 0.9:
        return f"granularity: {row['matrices']} matrices on {row['world_size']} ranks"
    predicted = row["predicted"]
    if predicted["optimizer_ms"] > 1.2 * predicted["ns_ms"]:
        return "network: exposed communication"
    return "balanced"


def format_table(rows: list[dict]) -> str:
    header = (f"{'model':<24}{'P':>6}{'mats':>6}{'batch':>6}{'NS eff':>8}{'LPT':>6}{'bytes/min':>10}"
              f"{'scratch MB':>11}{'NS ms':>8}{'comm ms':>9}{'opt ms':>8}{'train ms':>10}{'opt %':>7}  limit")
    lines = [header]
    for row in rows:
        p = row["predicted"]
        model = row["model"]
        if "replicas" in row:
            model += f" R={row['replicas']}{' split' if row['split_replicas'] else ' apart'}"
        ratio = row["bytes_sent_per_rank_max"] / row["bytes_minimum"] if row["bytes_minimum"] else 1.0
        lines.append(
            f"{model:<24}{row['world_size']:>6}{row['matrices']:>6}{row['batches']:>6}"
            f"{row['ns_efficiency']:>8.3f}{row['lpt_bound_efficiency']:>6.3f}{ratio:>10.3f}"
            f"{row['peak_scratch_bytes_per_rank'] / 2**20:>11.0f}{p['ns_ms']:>8.1f}{p['comm_ms']:>9.1f}"
            f"{p['optimizer_ms']:>8.1f}{p['train_step_ms']:>10.1f}{100 * p['optimizer_fraction']:>7.2f}  {limit(row)}"
        )
    return "\n".join(lines)


def load_shapes(path: Path) -> tuple[list[ParamSpec], int]:
    """``[[A, B], [E, A, B], ...]``, or ``{"shapes": [...], "params": N}``; an entry may also be
    ``{"shape": [...], "shard_dim": d, "ns_steps": k}``. ``params`` (for the train-step
    model) defaults to the elements of the shapes."""
    data = json.loads(path.read_text())
    entries, params = (data["shapes"], data.get("params")) if isinstance(data, dict) else (data, None)
    specs = []
    for entry in entries:
        if isinstance(entry, dict):
            specs.append(ParamSpec(tuple(entry["shape"]), entry.get("shard_dim", 0),
                                   entry.get("ns_steps", DEFAULT_NS_STEPS)))
        else:
            specs.append(ParamSpec(tuple(entry)))
    return specs, params if params is not None else sum(math.prod(s.shape) for s in specs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dmuon.tools.plan_report", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", nargs="+", choices=sorted(PRESETS), help="llama3 preset(s)")
    source.add_argument("--shapes", type=Path, help="JSON file of Muon matrix shapes")
    parser.add_argument("--world-size", type=int, nargs="+", required=True, help="rank count(s) P")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1],
                        help="HSDP replica count(s) R (P / R shards each); R > 1 prints a row with Newton-Schulz "
                             "split across replicas and one with replicas kept apart (default 1: FSDP)")
    parser.add_argument("--max-batch-numel", type=int, default=DEFAULT_BATCH_NUMEL,
                        help="DMuon's max_batch_numel (default %(default)s)")
    defaults = CostModel()
    parser.add_argument("--peak-tflops", type=float, default=defaults.peak_tflops, help="bf16 peak (default %(default)s)")
    parser.add_argument("--fp32-peak-tflops", type=float, default=defaults.fp32_peak_tflops,
                        help="fp32 peak without TF32, for --ns-dtype float32 (default %(default)s)")
    parser.add_argument("--ns-dtype", choices=sorted(NS_DTYPES), default="bfloat16",
                        help="what Newton-Schulz multiplies in (DMuon's ns_dtype; 'auto' is bfloat16 on GPUs); "
                             "sets its peak (default %(default)s)")
    parser.add_argument("--ns-algorithm", choices=NS_ALGORITHMS, default=DEFAULT_NS_ALGORITHM,
                        help="DMuon's ns_algorithm: what each matrix costs, so what owners balance; 'gram' and 'auto' "
                             "run Gram Newton-Schulz (fp16 on GPUs, at the bf16 peak) (default %(default)s)")
    parser.add_argument("--ns-mfu", type=float, default=defaults.ns_mfu, help="default %(default)s")
    parser.add_argument("--link-gbps", type=float, default=defaults.link_gbps, help="per-rank Gbit/s (default %(default)s)")
    parser.add_argument("--replica-link-gbps", type=float, default=defaults.replica_link_gbps,
                        help="per-rank Gbit/s to other replicas (default %(default)s)")
    parser.add_argument("--tokens-per-rank", type=int, default=defaults.tokens_per_rank, help="default %(default)s")
    parser.add_argument("--train-mfu", type=float, default=defaults.train_mfu, help="default %(default)s")
    parser.add_argument("--json", action="store_true", help="print JSON (one object, or a list for several rows)")
    args = parser.parse_args(argv)
    if any(p < 1 for p in args.world_size):
        parser.error("--world-size must be positive")
    cost = CostModel(peak_tflops=args.peak_tflops, fp32_peak_tflops=args.fp32_peak_tflops,
                     ns_dtype=NS_DTYPES[args.ns_dtype], ns_mfu=args.ns_mfu, link_gbps=args.link_gbps,
                     replica_link_gbps=args.replica_link_gbps, tokens_per_rank=args.tokens_per_rank,
                     train_mfu=args.train_mfu)
    if args.shapes:
        specs, params = load_shapes(args.shapes)
        models = [(args.shapes.stem, specs, params)]
    else:
        models = [(name, [ParamSpec(s) for s in PRESETS[name].matrices()], PRESETS[name].params()) for name in args.model]
    models = [(name, [replace(spec, ns_algorithm=args.ns_algorithm) for spec in specs], params)
              for name, specs, params in models]
    if any(r < 1 or p % r for r in args.replicas for p in args.world_size):
        parser.error("--replicas must divide every --world-size")
    rows = [report(name, specs, params, p, cost, args.max_batch_numel, r, split)
            for name, specs, params in models for p in args.world_size for r in args.replicas
            for split in ((True, False) if r > 1 else (True,))]
    if args.json:
        json.dump(rows[0] if len(rows) == 1 else rows, sys.stdout, indent=2)
        print()
    else:
        print(format_table(rows))


if __name__ == "__main__":
    main()
