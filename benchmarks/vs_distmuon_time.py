"""``python -m benchmarks.vs_distmuon --time``: DMuon and TorchTitan's DistMuon (and Dion's
and dtensor-muon's Muon where they import) measured on the same FSDP2-sharded stack.

The stack is ``benchmarks.bench``'s: ``--blocks`` llama3-shaped blocks of width
``--width`` (wq wk wv wo w1 w2 w3, named as TorchTitan's llama3 names them),
``fully_shard``-ed on a 1-D ``dp_shard`` mesh of P gloo ranks, one thread a rank
(``benchmarks.spawned_ranks``). For each P and optimizer, on a fresh copy of it:

- **agreement**: 3 steps with 3 different gradients, then the largest difference of the
  full weights from ``torch.optim.Muon`` run on the full, plain weights with the same
  gradients (rank 0, one process): 0 is bitwise agreement;
- **step ms**: the median over ``--steps`` steps after ``--warmup``, of the slowest rank
  (``benchmarks.bench_timing.time_steps``);
- **bytes sent** by each rank in one step (``benchmarks.sent_bytes``);
- **floor**: ``torch.optim.Muon``'s one-rank step on the full weights (rank 0 alone,
  the others waiting) over P; an optimizer's efficiency is the floor over its step.

Every optimizer gets the hyperparameters of ``benchmarks.vs_distmuon_peers``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import datetime
import importlib.metadata
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.bench_timing import time_steps
from benchmarks.bench_workload import BenchConfig, build_model
from benchmarks.layouts import like
from benchmarks.sent_bytes import count_sent
from benchmarks.spawned_ranks import run_on_ranks
from benchmarks.vs_distmuon_peers import BUILDERS, HYPERPARAMETERS, skip_reason, titan_fqn, torch_muon
from benchmarks.vs_distmuon_tables import timed_header, timed_table
from dmuon.tools import native_bf16_matmul

WORLD_SIZES = (1, 2, 4)
WIDTH = 512
BLOCKS = 4
STEPS = 10
WARMUP = 3
AGREEMENT_STEPS = 3
GRAD_SEED = 100
LAUNCH_TIMEOUT_S = 1800.0  # one world size, every optimizer; P = 4 at width 512 takes minutes on 2 cores
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Settings:
    """One ``--time`` run's settings (the command line's)."""

    width: int = WIDTH
    blocks: int = BLOCKS
    steps: int = STEPS
    warmup: int = WARMUP
    world_sizes: tuple[int, ...] = WORLD_SIZES
    optimizers: tuple[str, ...] = tuple(BUILDERS)
    timeout_s: float = LAUNCH_TIMEOUT_S


# ---------------------------------------------------------------- on every rank

def _stack(settings: Settings) -> tuple[list[nn.Parameter], list[str]]:
    """A fresh FSDP2-sharded stack (the same initial weights every time) and its
    parameters' TorchTitan FQNs."""
    cfg = BenchConfig(dim=settings.width, layers=settings.blocks, mesh_shape=(dist.get_world_size(),))
    model = build_model(cfg, CPU)
    return list(model.parameters()), [titan_fqn(name) for name, _ in model.named_parameters()]


def _full_grads(shapes: Sequence[torch.Size], step: int) -> list[torch.Tensor]:
    """Step ``step``'s full gradients: the same on every rank and for every optimizer."""
    generator = torch.Generator().manual_seed(GRAD_SEED + step)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _reference_and_floor(initial: list[torch.Tensor], grads: list[list[torch.Tensor]],
                         settings: Settings) -> tuple[list[torch.Tensor] | None, float]:
    """On rank 0: ``torch.optim.Muon`` on the full weights after the agreement steps, and
    its one-rank step time (the other ranks wait through it)."""
    leader = dist.get_rank() == 0
    weights = [nn.Parameter(t.clone()) for t in initial] if leader else []
    muon = torch_muon(weights) if leader else None

    def step(step_grads: list[torch.Tensor]) -> None:
        if leader:
            for weight, grad in zip(weights, step_grads):
                weight.grad = grad
            muon.step()

    for step_grads in grads:
        step(step_grads)
    reference = [w.detach().clone() for w in weights] if leader else None
    timing = BenchConfig(steps=settings.steps, warmup=settings.warmup)
    return reference, time_steps(lambda: step(grads[0]), timing, CPU, "torch.optim.Muon, one rank")


def _largest_difference(params: list[nn.Parameter], reference: list[torch.Tensor] | None) -> float | None:
    """Rank 0: the largest |difference| of the full weights from the reference (NaN if
    either is not finite); None on the other ranks, which only help gather."""
    full = [p.full_tensor() for p in params]
    if reference is None:
        return None
    return max((f - r).abs().max().item() for f, r in zip(full, reference))


def _measure(name: str, settings: Settings, grads: list[list[torch.Tensor]],
             reference: list[torch.Tensor] | None) -> dict:
    """One optimizer at this world size: agreement, step time, bytes sent."""
    params, fqns = _stack(settings)
    optimizer = BUILDERS[name](params, fqns)
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = like(param, grad)
        optimizer.step()
    difference = _largest_difference(params, reference)
    timed_grads = [like(param, grad) for param, grad in zip(params, grads[0])]

    def step() -> None:
        for param, grad in zip(params, timed_grads):
            param.grad = grad
        optimizer.step()

    step_ms = time_steps(step, BenchConfig(steps=settings.steps, warmup=settings.warmup), CPU, name)
    with count_sent() as counts:
        step()
    sent = [None] * dist.get_world_size()
    dist.all_gather_object(sent, dict(counts))
    return {"optimizer": name, "step_ms": step_ms, "max_abs_diff": difference,
            "bytes_sent_per_rank": [sum(c.values()) for c in sent], "bytes_by_collective": sent}


def measure_world(settings: Settings, names: Sequence[str]) -> dict:
    """Every optimizer of ``names`` at this group's world size (rank 0's answer is the
    report's; progress lines go to stderr, so that stdout stays the table or JSON)."""
    with contextlib.redirect_stdout(sys.stderr):
        world = dist.get_world_size()
        params, _fqns = _stack(settings)
        initial = [p.full_tensor() for p in params]
        grads = [_full_grads([p.shape for p in params], k) for k in range(AGREEMENT_STEPS)]
        del params
        reference, one_rank_ms = _reference_and_floor(initial, grads, settings)
        rows = [_measure(name, settings, grads, reference) for name in names]
    floor_ms = one_rank_ms / world
    for row in rows:
        row.update(world_size=world, one_rank_ms=one_rank_ms, floor_ms=floor_ms,
                   efficiency=floor_ms / row["step_ms"], bytes_sent_max=max(row["bytes_sent_per_rank"]),
                   bitwise=row["max_abs_diff"] == 0.0)
    return {"world_size": world, "one_rank_ms": one_rank_ms, "rows": rows}


# ---------------------------------------------------------------- the run

def machine() -> dict:
    """What the figures depend on: CPU, cores, versions, how busy the machine was."""
    try:
        titan = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        titan = None
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_model": _cpu_model(),
            "native_bf16_matmul": native_bf16_matmul("cpu"), "cores": os.cpu_count(), "threads_per_rank": 1,
            "load_average_1_5_15": list(os.getloadavg()), "torch": torch.__version__, "torchtitan": titan,
            "python": sys.version.split()[0]}


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return None


def run_timed(settings: Settings, argv: Sequence[str]) -> dict:
    """Every world size of ``settings``, one launch each; the report (JSON-ready)."""
    skipped = {name: reason for name in settings.optimizers if (reason := skip_reason(name))}
    present = [name for name in settings.optimizers if name not in skipped]
    report = {"command": shlex.join(["python", "-m", "benchmarks.vs_distmuon", *argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "settings": asdict(settings), "hyperparameters": HYPERPARAMETERS,
              "skipped": skipped, "worlds": []}
    for world in settings.world_sizes:
        print(f"vs_distmuon --time: P = {world}: {', '.join(present)}", file=sys.stderr, flush=True)
        report["worlds"].append(run_on_ranks(measure_world, world, settings, present, timeout=settings.timeout_s)[0])
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--time`` and its options, on ``python -m benchmarks.vs_distmuon``'s parser."""
    measured = parser.add_argument_group("measured on CPU ranks (--time)")
    measured.add_argument("--time", action="store_true", help="measure the optimizers instead of computing bytes")
    measured.add_argument("--width", type=int, default=WIDTH, help="model width (default %(default)s)")
    measured.add_argument("--blocks", type=int, default=BLOCKS, help="blocks of 7 matrices (default %(default)s)")
    measured.add_argument("--steps", type=int, default=STEPS, help="timed steps (default %(default)s)")
    measured.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps (default %(default)s)")
    measured.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES),
                          help="P, one launch each (default %(default)s)")
    measured.add_argument("--optimizers", nargs="+", choices=tuple(BUILDERS), default=list(BUILDERS),
                          help="those to run (default: all; absent ones are reported as absent)")
    measured.add_argument("--timeout", type=float, default=LAUNCH_TIMEOUT_S,
                          help="seconds one world size may take (default %(default)s)")


def main_timed(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Run ``--time`` and print its table, or its report as JSON with ``--json``."""
    settings = Settings(args.width, args.blocks, args.steps, args.warmup, tuple(args.world_sizes),
                        tuple(args.optimizers), args.timeout)
    report = run_timed(settings, argv)
    print(json.dumps(report, indent=2) if args.json else f"{timed_header(report)}\n\n{timed_table(report)}")
