"""How the step benchmark measures a row: its step time, the bytes it sends, and
Newton-Schulz's throughput, on the device it picked (and rank 0's progress lines).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.bench_workload import BenchConfig
from dmuon import orthogonalize
from dmuon.tools import native_bf16_matmul, newton_schulz_flops, NS_DTYPES


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
        log_rank0(f"  {label}: step {i + 1}/{cfg.warmup + cfg.steps} {elapsed.item() * 1e3:8.1f} ms"
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


def resolve_device(choice: str = "auto") -> torch.device:
    """This rank's device for ``--device`` ``choice``: a GPU (the one numbered ``LOCAL_RANK``) or the CPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """The device as the report names it; for a CPU, what decides its bf16 rows' speed too."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    native = "yes" if native_bf16_matmul("cpu") else "no"
    return f"cpu ({os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul: {native})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log_rank0(message: str) -> None:
    """Print on rank 0 only: every rank runs the same steps, one copy of each line is enough."""
    if dist.get_rank() == 0:
        print(message, flush=True)
