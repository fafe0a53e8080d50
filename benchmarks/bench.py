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
Newton-Schulz depend on the layout (``dmuon.tools.plan_report.min_bytes_per_rank``; ``4 N (P-1) / P^2``
for FSDP).

This module runs the rows and reads the command line; ``benchmarks.bench_workload``
holds the settings, the rows and the model they step, ``benchmarks.bench_timing`` how
a row is measured, ``benchmarks.bench_report`` the table, the JSON and the chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.bench_report import write_report
from benchmarks.bench_timing import (
    device_name,
    log_rank0,
    newton_schulz_throughput,
    profiled_bytes_sent,
    resolve_device,
    time_steps,
)
from benchmarks.bench_workload import (
    BF16_ROWS,
    DMUON_ROWS,
    FAST_PATH_ROWS,
    LR,
    OPTIMIZERS,
    SLOW_BF16_REASON,
    BenchConfig,
    Block,
    build_model,
    make_grads,
    slow_bf16_rows,
)
from benchmarks.layouts import LAYOUTS, default_mesh_shape
from dmuon import DMuon
from dmuon.tools import (DEFAULT_NS_STEPS, min_bytes_per_rank, newton_schulz_flops, NS_ALGORITHMS, NS_DTYPE_CHOICES,
                         ns_dtype_name, resolve_ns_algorithm, resolve_ns_dtype)


def run_benchmark(cfg: BenchConfig) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = resolve_device(cfg.device)
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
    log_rank0(f"benchmarks.bench: {world} rank(s) on {device.type}, {cfg.threads} thread(s) each; "
              f"layout {cfg.layout} on mesh {cfg.mesh_shape}; {cfg.layers} blocks of width {cfg.dim}: "
              f"{len(shapes)} matrices, {muon_elements / 1e6:.1f}M elements")

    ns_dtype = ns_dtype_name(ns_compute)
    left_out = slow_bf16_rows(cfg.optimizers, device.type, cfg.bf16_rows)
    if left_out:
        log_rank0(f"left out {', '.join(left_out)}: {SLOW_BF16_REASON}")
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
        "device": device_name(device),
        "threads_per_rank": cfg.threads,
        "layout": cfg.layout,
        "mesh_shape": list(cfg.mesh_shape),
        "split_replicas": cfg.split_replicas,
        "min_bytes_per_rank": min_bytes_per_rank(cfg.layout, cfg.mesh_shape, muon_elements, cfg.split_replicas),
        "ns_flops_total": ns_flops_total,
        "ns_algorithm": cfg.ns_algorithm,
        "momentum_dtype": cfg.momentum_dtype,
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
        write_report(report, cfg.json, cfg.plot)
    return report


def _row_ns_dtype(name: str, ns_dtype: str) -> str | None:
    """The dtype a row's Newton-Schulz runs in (None: the row runs none)."""
    if name in ("dmuon_bf16", "vanilla"):  # torch.optim.Muon computes in bf16
        return "bfloat16"
    return ns_dtype if name in DMUON_ROWS else None


def _bench_single(cfg: BenchConfig, device: torch.device) -> dict[str, float]:
    """Rank 0 alone: DMuon on full plain tensors (the P = 1 baseline); others wait."""
    model = build_model(cfg, device)
    grads = [g.full_tensor() for g in make_grads(model)]
    params = [nn.Parameter(p.full_tensor()) for p in model.parameters()]
    optimizer = DMuon(params, lr=LR, ns_dtype=cfg.ns_dtype, ns_algorithm=cfg.ns_algorithm,
                      momentum_dtype=cfg.momentum_dtype)

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
                     ns_algorithm=cfg.ns_algorithm, momentum_dtype=cfg.momentum_dtype)
    if name == "redistribute":
        return DMuon(params, lr=LR, comm="redistribute", ns_dtype=cfg.ns_dtype, ns_algorithm=cfg.ns_algorithm,
                     momentum_dtype=cfg.momentum_dtype)
    if name == "vanilla":
        return torch.optim.Muon(params, lr=LR)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, foreach=True)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


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
    parser.add_argument("--momentum-dtype", choices=("bfloat16", "int8"), default=None,
                        help="DMuon's momentum_dtype for the DMuon rows (default: the parameters' dtype)")
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
                       args.ns_algorithm, args.momentum_dtype, bf16_rows, args.json, args.plot)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    # Also runnable as plain `python -m benchmarks.bench`: a one-rank group.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    device = resolve_device(cfg.device)
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
