"""Optimizer-step benchmark on a llama-like stack of FSDP2-sharded matrices.

Run::

    torchrun --nproc-per-node 2 -m benchmarks.bench [--json PATH] [--dim 512 --layers 4]
        [--max-batch-numel N] [--device auto|cpu|cuda] [--layout fsdp|hsdp|fsdp_tp|tp [--mesh R,S]]
        [--ns-dtype auto|bfloat16|float32] [--ns-algorithm standard|gram|auto] [--bf16-rows]

Every optimizer steps the same model (parallelized per ``--layout``, see
``benchmarks.layouts``: by default ``fully_shard``-ed, so parameters are ``Shard(0)``
DTensors) with the same gradients:

- ``dmuon``: DMuon's owner-computed fast path (``comm="all_to_all"``);
- ``dmuon_bf16``: the same with Newton-Schulz in bf16, the dtype ``vanilla`` computes in,
  so that "vs vanilla" compares like with like (skipped when ``dmuon`` is bf16 already);
- ``redistribute``: DMuon's reference path (every rank gathers every matrix);
- ``vanilla``: ``torch.optim.Muon`` applied directly to the DTensors;
- ``adamw``: ``torch.optim.AdamW(foreach=True)`` on the shards;
- ``single``: rank 0 alone runs DMuon on full plain tensors while the others wait;
  ``single / (P * dmuon)`` is the parallel efficiency of the fast path.

DMuon rows use ``--ns-dtype`` (default ``auto``: bf16 on GPUs and CPUs with a native bf16
matmul, fp32 elsewhere), and the table says which dtype each row ran. A last row gives
the throughput of Newton-Schulz on one ``dim x dim`` matrix in each dtype, on rank 0.
DMuon rows also use ``--ns-algorithm`` (default ``standard``; ``gram``, ``auto``: Gram
Newton-Schulz, ``dmuon.numerics.gram_newton_schulz``), and the table says which.

On a CPU without a native bf16 matmul (``torch.backends.cpu.get_cpu_capability()`` AVX2,
``dmuon.torch_compat.mkldnn_bf16_supported()`` False) the bf16 rows (``dmuon_bf16``,
``vanilla``) run torch's scalar bf16 GEMM, ~50x slower than fp32 (~86 s a step of the
default model), so there they are left out unless asked for (``--bf16-rows``, or naming
them in ``--optimizers``); the output says which rows were left out and why.

Step time is the median, over timed steps after warm-up, of the slowest rank's time.
Bytes sent per rank: DMuon's own exact counters for ``dmuon``; for the others, the
collectives the profiler sees at the backend (gloo/NCCL) level, costed as ring
algorithms (all-reduce ``2(P-1)/P n``, all-gather ``(P-1) n_in``, reduce-scatter and
all-to-all ``(P-1)/P n_in``). The minimum bytes per rank of owner-computed
Newton-Schulz depend on the layout (``dmuon.plan_report.min_bytes_per_rank``; ``4 N (P-1) / P^2``
for FSDP).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from benchmarks.layouts import LAYOUTS, default_mesh_shape, like, parallelize
from dmuon.numerics.newton_schulz import (
    DEFAULT_NS_ALGORITHM,
    DEFAULT_NS_DTYPE,
    DEFAULT_NS_STEPS,
    NS_ALGORITHMS,
    NS_DTYPE_CHOICES,
    NS_DTYPES,
    native_bf16_matmul,
    newton_schulz_flops,
    ns_dtype_name,
    orthogonalize,
    resolve_ns_algorithm,
    resolve_ns_dtype,
)
from dmuon.optimizer import DMuon
from dmuon.plan import DEFAULT_BATCH_NUMEL
from dmuon.plan_report import min_bytes_per_rank

OPTIMIZERS = ("dmuon", "dmuon_bf16", "redistribute", "vanilla", "adamw", "single")
# The rows that run DMuon, and so Newton-Schulz in the chosen dtype (dmuon_bf16: in bf16),
# and those on its fast path, whose bytes come from its own exact counters.
DMUON_ROWS = ("dmuon", "dmuon_bf16", "redistribute", "single")
FAST_PATH_ROWS = ("dmuon", "dmuon_bf16")
# The rows whose Newton-Schulz runs in bf16 whatever --ns-dtype says: torch.optim.Muon's
# dtype, for the like-for-like comparison with it.
BF16_ROWS = ("dmuon_bf16", "vanilla")
LR = 0.02


@dataclass
class BenchConfig:
    dim: int = 512
    """Model width: attention matrices are dim x dim."""
    layers: int = 4
    """Transformer blocks, 7 matrices each (wq, wk, wv, wo, w1, w2, w3)."""
    steps: int = 10
    """Timed steps per optimizer."""
    warmup: int = 3
    """Untimed steps before timing."""
    threads: int = 1
    """torch threads per rank (CPU)."""
    optimizers: tuple[str, ...] = OPTIMIZERS
    max_batch_numel: int = DEFAULT_BATCH_NUMEL
    """DMuon's max_batch_numel (small values: one matrix per batch)."""
    device: str = "auto"
    """"cuda" (one GPU per rank, NCCL), "cpu" (gloo), or "auto": cuda when available."""
    layout: str = "fsdp"
    """How the stack is parallelized: one of ``benchmarks.layouts.LAYOUTS``."""
    mesh_shape: tuple[int, ...] = ()
    """The layout's mesh; empty: ``default_mesh_shape(layout, world size)``."""
    split_replicas: bool = True
    """DMuon's split_replicas (matters for ``hsdp`` only)."""
    ns_dtype: str = DEFAULT_NS_DTYPE
    """DMuon's ns_dtype for the DMuon rows (``dmuon_bf16`` always runs bf16)."""
    ns_algorithm: str = DEFAULT_NS_ALGORITHM
    """DMuon's ns_algorithm for the DMuon rows."""
    bf16_rows: bool = False
    """Run the bf16 rows (``BF16_ROWS``) also on a CPU whose bf16 matmul is slow."""
    json: str | None = None
    """Write the results here as JSON."""
    plot: str | None = None
    """Write a PNG bar chart of step time and bytes sent here (needs matplotlib)."""


def ffn_hidden(dim: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU hidden size: 2/3 of 4 * dim, rounded up to ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * -(-hidden // multiple_of)


class Block(nn.Module):
    """The matrices of one llama block (no norms: they hold no Muon work)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = ffn_hidden(dim)
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, nn.Linear(dim, dim, bias=False))
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)


def build_model(cfg: BenchConfig, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(cfg.dim) for _ in range(cfg.layers))).to(device)
    parallelize(model, cfg.layout, cfg.mesh_shape, device.type)
    return model


def make_grads(model: nn.Module) -> list[DTensor]:
    """Deterministic full gradients (the same on every rank, so replicas agree), laid
    out like the parameters."""
    generator = torch.Generator().manual_seed(1)
    return [like(p, torch.randn(p.shape, generator=generator).to(p.device)) for p in model.parameters()]


def time_steps(step: Callable[[], None], cfg: BenchConfig, device: torch.device, label: str) -> float:
    """Median over timed steps of the slowest rank's step time, in ms."""
    times = []
    for i in range(cfg.warmup + cfg.steps):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= cfg.warmup:
            times.append(elapsed.item() * 1e3)
        _log(f"  {label}: step {i + 1}/{cfg.warmup + cfg.steps} {elapsed.item() * 1e3:8.1f} ms"
             f"{'  (warm-up)' if i < cfg.warmup else ''}")
    return statistics.median(times)


def profiled_bytes_sent(step: Callable[[], None], world_size: int) -> int:
    """Bytes this rank sends in one ``step()``, from the backend collectives the profiler records."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    total = 0.0
    for event in prof.events():
        backend, _, op = event.name.partition(":")
        if backend not in ("gloo", "nccl") or not event.input_shapes or not event.input_shapes[0]:
            continue
        numel = 1
        for size in event.input_shapes[0]:
            numel *= size
        dtypes = getattr(event, "input_dtypes", None) or ["float"]
        nbytes = numel * _element_size(dtypes[0])
        p = world_size
        if "all_reduce" in op or "allreduce" in op:
            total += 2 * (p - 1) / p * nbytes
        elif "all_gather" in op or "allgather" in op:
            total += (p - 1) * nbytes
        elif "reduce_scatter" in op or "all_to_all" in op or "alltoall" in op:
            total += (p - 1) / p * nbytes
        elif "broadcast" in op or "scatter" in op:
            total += (p - 1) / p * nbytes
    return int(total)


def _element_size(dtype_name: str) -> int:
    name = str(dtype_name).lower()
    if any(k in name for k in ("bfloat16", "half", "float16", "short", "int16")):
        return 2
    if any(k in name for k in ("double", "int64", "long")):
        return 8
    if any(k in name for k in ("char", "int8", "bool", "byte")):
        return 1
    return 4


def slow_bf16_rows(optimizers: tuple[str, ...], device_type: str, asked: bool) -> tuple[str, ...]:
    """The bf16 rows left out of this run, unless ``asked``: those of ``optimizers`` on a
    CPU without a native bf16 matmul, where their Newton-Schulz alone takes minutes a step."""
    if asked or native_bf16_matmul(device_type):
        return ()
    return tuple(name for name in optimizers if name in BF16_ROWS)


def run_benchmark(cfg: BenchConfig) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(cfg.device)
    if not cfg.mesh_shape:
        cfg = dataclasses.replace(cfg, mesh_shape=default_mesh_shape(cfg.layout, world))
    if math.prod(cfg.mesh_shape) != world:
        raise ValueError(f"mesh {cfg.mesh_shape} does not have {world} ranks")
    results: dict[str, dict[str, float]] = {}
    shapes = [tuple(p.shape) for p in Block(cfg.dim).parameters()] * cfg.layers
    muon_elements = sum(math.prod(s) for s in shapes)
    ns_compute = resolve_ns_dtype(cfg.ns_dtype, device.type)
    algorithm = resolve_ns_algorithm(cfg.ns_algorithm, ns_compute, device.type)
    ns_flops_total = sum(newton_schulz_flops(s, DEFAULT_NS_STEPS, algorithm) for s in shapes)
    _log(f"benchmarks.bench: {world} rank(s) on {device.type}, {cfg.threads} thread(s) each; layout {cfg.layout} "
         f"on mesh {cfg.mesh_shape}; {cfg.layers} blocks of width {cfg.dim}: {len(shapes)} matrices, "
         f"{muon_elements / 1e6:.1f}M elements")

    ns_dtype = ns_dtype_name(ns_compute)
    left_out = slow_bf16_rows(cfg.optimizers, device.type, cfg.bf16_rows)
    if left_out:
        _log(f"left out {', '.join(left_out)}: {SLOW_BF16_REASON}")
    optimizers = [name for name in cfg.optimizers
                  if not (name == "dmuon_bf16" and ns_dtype == "bfloat16") and name not in left_out]
    for name in optimizers:
        if name == "single":
            results[name] = _bench_single(cfg, device) | {"ns_dtype": ns_dtype}
            continue
        model = build_model(cfg, device)
        params = list(model.parameters())
        grads = make_grads(model)
        optimizer = _make_optimizer(name, params, cfg)

        def step() -> None:
            for param, grad in zip(params, grads):
                param.grad = grad
            optimizer.step()

        step_ms = time_steps(step, cfg, device, name)
        ns_flops = 0
        if name in FAST_PATH_ROWS:  # its own exact counters
            before, flops_before = optimizer.comm_stats.bytes_sent, optimizer.comm_stats.ns_flops
            step()
            sent = optimizer.comm_stats.bytes_sent - before
            ns_flops = optimizer.comm_stats.ns_flops - flops_before
        else:
            sent = profiled_bytes_sent(step, world)
        maxima = torch.tensor([sent, ns_flops], dtype=torch.float64)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        results[name] = {"step_ms": step_ms, "bytes_sent_per_rank": int(maxima[0].item()),
                         "ns_dtype": _row_ns_dtype(name, ns_dtype)}
        if name == "dmuon":
            results[name]["ns_flops_per_rank_max"] = int(maxima[1].item())
            results[name]["batches"] = len(optimizer.owner_plans()[0].batches) if world > 1 else 0
        del optimizer, model, params, grads

    throughput = newton_schulz_throughput(cfg.dim, device) if dist.get_rank() == 0 else {}
    dist.barrier()
    report = {
        "world_size": world,
        "dim": cfg.dim,
        "muon_elements": muon_elements,
        "device": _device_name(device),
        "threads_per_rank": cfg.threads,
        "layout": cfg.layout,
        "mesh_shape": list(cfg.mesh_shape),
        "split_replicas": cfg.split_replicas,
        "min_bytes_per_rank": min_bytes_per_rank(cfg.layout, cfg.mesh_shape, muon_elements, cfg.split_replicas),
        "ns_flops_total": ns_flops_total,
        "ns_algorithm": cfg.ns_algorithm,
        "max_batch_numel": cfg.max_batch_numel,
        "left_out": {name: SLOW_BF16_REASON for name in left_out},
        "results": results,
        "ns_throughput_gflops": throughput,
    }
    if "single" in results and "dmuon" in results:
        report["parallel_efficiency"] = results["single"]["step_ms"] / (world * results["dmuon"]["step_ms"])
    like_vanilla = next((results[n] for n in ("dmuon", "dmuon_bf16") if results.get(n, {}).get("ns_dtype") == "bfloat16"),
                        None)
    if "vanilla" in results and like_vanilla:
        report["speedup_vs_vanilla"] = results["vanilla"]["step_ms"] / like_vanilla["step_ms"]
    if rank == 0:
        print(format_table(report), flush=True)
        if cfg.json:
            with open(cfg.json, "w") as f:
                json.dump(report, f, indent=2)
            print(f"wrote {cfg.json}", flush=True)
        if cfg.plot:
            plot_report(report, cfg.plot)
            print(f"wrote {cfg.plot}", flush=True)
    return report


# Why slow_bf16_rows leaves rows out, as the output says it.
SLOW_BF16_REASON = (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16 matmul, so their bf16 "
                    "Newton-Schulz runs ~50x slower than fp32 (minutes a step); pass --bf16-rows to run them "
                    "(the like-for-like comparison with torch.optim.Muon)")


def _row_ns_dtype(name: str, ns_dtype: str) -> str | None:
    """The dtype a row's Newton-Schulz runs in (None: the row runs none)."""
    if name in ("dmuon_bf16", "vanilla"):  # torch.optim.Muon computes in bf16
        return "bfloat16"
    return ns_dtype if name in DMUON_ROWS else None


def newton_schulz_throughput(dim: int, device: torch.device, repeats: int = 2) -> dict[str, float]:
    """GFLOP/s of Newton-Schulz on one ``dim x dim`` matrix in each compute dtype (best of
    ``repeats`` after a small warm-up), on this rank alone."""
    generator = torch.Generator().manual_seed(2)
    matrix = torch.randn(dim, dim, generator=generator).bfloat16().to(device)
    flops = newton_schulz_flops(matrix.shape)
    rates = {}
    for name, dtype in NS_DTYPES.items():
        orthogonalize(matrix[:64, :64], dtype=dtype)
        best = math.inf
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            orthogonalize(matrix, dtype=dtype)
            _sync(device)
            best = min(best, time.perf_counter() - start)
        rates[name] = flops / best / 1e9
    return rates


def _bench_single(cfg: BenchConfig, device: torch.device) -> dict[str, float]:
    """Rank 0 alone: DMuon on full plain tensors (the P = 1 baseline); others wait."""
    model = build_model(cfg, device)
    grads = [g.full_tensor() for g in make_grads(model)]
    params = [nn.Parameter(p.full_tensor()) for p in model.parameters()]
    optimizer = DMuon(params, lr=LR, ns_dtype=cfg.ns_dtype, ns_algorithm=cfg.ns_algorithm)

    def step() -> None:
        if dist.get_rank() == 0:
            for param, grad in zip(params, grads):
                param.grad = grad
            optimizer.step()

    return {"step_ms": time_steps(step, cfg, device, "single"), "bytes_sent_per_rank": 0}


def _make_optimizer(name: str, params: list[torch.Tensor], cfg: BenchConfig) -> torch.optim.Optimizer:
    if name in ("dmuon", "dmuon_bf16"):
        return DMuon(params, lr=LR, comm="all_to_all", max_batch_numel=cfg.max_batch_numel,
                     split_replicas=cfg.split_replicas, ns_dtype="bfloat16" if name == "dmuon_bf16" else cfg.ns_dtype,
                     ns_algorithm=cfg.ns_algorithm)
    if name == "redistribute":
        return DMuon(params, lr=LR, comm="redistribute", ns_dtype=cfg.ns_dtype, ns_algorithm=cfg.ns_algorithm)
    if name == "vanilla":
        return torch.optim.Muon(params, lr=LR)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, foreach=True)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def format_table(report: dict) -> str:
    """A plain-text table of a benchmark report."""
    results = report["results"]
    vanilla = results.get("vanilla", {}).get("step_ms")
    lines = [
        f"world size {report['world_size']}, {report['device']}, {report['threads_per_rank']} thread(s)/rank, "
        f"Muon elements N = {report['muon_elements']:,}, layout {report['layout']} on mesh {report['mesh_shape']}, "
        f"DMuon ns_algorithm {report.get('ns_algorithm', DEFAULT_NS_ALGORITHM)}",
        f"{'optimizer':<14}{'NS dtype':>10}{'step ms':>10}{'vs vanilla':>12}{'bytes sent/rank':>18}",
    ]
    for name, row in results.items():
        # Only a row whose Newton-Schulz runs in bf16, as vanilla's does, is compared with it.
        comparable = vanilla and row.get("ns_dtype") in ("bfloat16", None)
        speedup = f"{vanilla / row['step_ms']:.2f}x" if comparable else "-"
        lines.append(f"{name:<14}{row.get('ns_dtype') or '-':>10}{row['step_ms']:>10.1f}{speedup:>12}"
                     f"{row['bytes_sent_per_rank']:>18,}")
    lines += [f"{name:<14}{'left out':>10}: {reason}" for name, reason in report.get("left_out", {}).items()]
    lines.append(f"owner-exchange minimum for this layout = {report['min_bytes_per_rank']:,} bytes/rank "
                 f"(dmuon.plan_report.min_bytes_per_rank)")
    dmuon = results.get("dmuon", {})
    if "ns_flops_per_rank_max" in dmuon:
        ideal = report["ns_flops_total"] / report["world_size"]
        lines.append(f"dmuon: {dmuon['batches']} batch(es) (max_batch_numel {report['max_batch_numel']:,}), "
                     f"Newton-Schulz GFLOP on the busiest rank {dmuon['ns_flops_per_rank_max'] / 1e9:.2f} "
                     f"= {dmuon['ns_flops_per_rank_max'] / ideal:.2f} x total/P")
    if "parallel_efficiency" in report:
        lines.append(f"parallel efficiency single / (P * dmuon) = {report['parallel_efficiency']:.2f}")
    rates = report.get("ns_throughput_gflops")
    if rates:
        dim = report.get("dim", "dim")
        lines.append(f"Newton-Schulz on one {dim} x {dim} matrix, rank 0: "
                     + ", ".join(f"{name} {rate:.1f} GFLOP/s" for name, rate in rates.items())
                     + f" (fp32 / bf16 = {rates['float32'] / rates['bfloat16']:.2f})")
    return "\n".join(lines)


def plot_report(report: dict, path: str) -> None:
    """Two bar charts side by side: median step time and bytes sent per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    step_ms = [report["results"][n]["step_ms"] for n in names]
    mbytes = [report["results"][n]["bytes_sent_per_rank"] / 1e6 for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, step_ms, color="tab:blue")
    left.set_ylabel("median step (ms, slowest rank)")
    right.bar(names, mbytes, color="tab:orange")
    right.axhline(report["min_bytes_per_rank"] / 1e6, color="black", linestyle="--", linewidth=1,
                  label="owner-computed minimum 4N(P-1)/P²")
    right.set_ylabel("MB sent per rank per step")
    right.legend(fontsize=8, loc="center left")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=20)
    fig.suptitle(f"benchmarks.bench: {report['world_size']} rank(s), {report['device']}, "
                 f"N = {report['muon_elements'] / 1e6:.1f}M Muon elements", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _device(choice: str = "auto") -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    native = "yes" if native_bf16_matmul("cpu") else "no"
    return f"cpu ({os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul: {native})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    defaults = BenchConfig()
    parser.add_argument("--dim", type=int, default=defaults.dim, help="model width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="blocks of 7 matrices (default %(default)s)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps (default %(default)s)")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads per rank (default %(default)s)")
    parser.add_argument("--optimizers", default=None,
                        help=f"comma-separated subset of {','.join(OPTIMIZERS)} (default: all)")
    parser.add_argument("--max-batch-numel", type=int, default=defaults.max_batch_numel,
                        help="DMuon's max_batch_numel (default %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=defaults.device,
                        help="cuda: one GPU per rank with NCCL (default %(default)s)")
    parser.add_argument("--layout", choices=LAYOUTS, default=defaults.layout,
                        help="how the stack is parallelized (default %(default)s; see benchmarks.layouts)")
    parser.add_argument("--mesh", default="", help="mesh shape, e.g. 2,2 (default: per layout, see benchmarks.layouts)")
    parser.add_argument("--no-split-replicas", action="store_true",
                        help="hsdp: keep each replica's Newton-Schulz to itself")
    parser.add_argument("--ns-dtype", choices=NS_DTYPE_CHOICES, default=defaults.ns_dtype,
                        help="DMuon's Newton-Schulz compute dtype (default %(default)s)")
    parser.add_argument("--ns-algorithm", choices=NS_ALGORITHMS, default=defaults.ns_algorithm,
                        help="DMuon's Newton-Schulz algorithm (default %(default)s)")
    parser.add_argument("--bf16-rows", action="store_true",
                        help=f"run {' and '.join(BF16_ROWS)} (Newton-Schulz in bf16, like torch.optim.Muon) also on a "
                             "CPU without a native bf16 matmul, where they take minutes a step (default: left out there)")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart to this path (needs matplotlib)")
    args = parser.parse_args(argv)
    chosen = OPTIMIZERS if args.optimizers is None else tuple(name for name in args.optimizers.split(",") if name)
    # Naming a bf16 row in --optimizers asks for it as --bf16-rows does.
    bf16_rows = args.bf16_rows or (args.optimizers is not None and any(name in BF16_ROWS for name in chosen))
    unknown = set(chosen) - set(OPTIMIZERS)
    if unknown:
        parser.error(f"unknown optimizer(s) {sorted(unknown)}; choose from {OPTIMIZERS}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    mesh_shape = tuple(int(n) for n in args.mesh.split(",") if n)
    return BenchConfig(args.dim, args.layers, args.steps, args.warmup, args.threads, chosen, args.max_batch_numel,
                       args.device, args.layout, mesh_shape, not args.no_split_replicas, args.ns_dtype,
                       args.ns_algorithm, bf16_rows, args.json, args.plot)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    # Also runnable as plain `python -m benchmarks.bench`: a one-rank group.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    device = _device(cfg.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        run_benchmark(cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
