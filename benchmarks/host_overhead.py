"""Host overhead of an optimizer step: host milliseconds and aten ops per step on models
with real parameter *structures* at tiny widths, so that arithmetic is negligible and
what remains is host work (Python, dispatch, one kernel launch per op on a GPU).

Run from the repository root::

    python -m benchmarks.host_overhead [--models llama3_8b,llama3_70b,moe] [--ranks 1,2,4]
        [--optimizers dmuon,dmuon_foreach,adamw,muon] [--steps 20 --warmup 2] [--json PATH] [--plot PNG]

Each ``P`` starts ``P`` gloo ranks on this machine (one thread each); the model is
``fully_shard``-ed block by block (FSDP2, ``Shard(0)`` DTensors), every optimizer steps
the same deterministic grads, and each row reports:

- ``host_ms``: the median over ``--steps`` timed steps (after ``--warmup``) of the slowest
  rank's ``step()`` time; on CPU it is all host time plus tiny arithmetic;
- ``ops``: the aten ops one ``step()`` dispatches on the busiest rank, counted with a
  ``TorchDispatchMode`` (views and metadata ops included; an op on a DTensor counts once);
  ``top_ops``: that rank's most frequent ones.

The op counts are deterministic (docs/benchmark.md records them); the times are the
machine's. Under the table, the issue's acceptance figures (``ACCEPTANCE_OPS``, and
``DMuon(foreach=True)``'s time over ``torch.optim.AdamW(foreach=True)``'s) are checked
for the rows that ran.

Optimizers: ``dmuon`` (``DMuon()``, torch's per-device default for ``foreach``),
``dmuon_foreach`` (``DMuon(foreach=True)``), ``dmuon_capturable`` (``DMuon(capturable=True)``:
its hyperparameters on the device, issue 42), ``dmuon_momentum_bf16`` and ``dmuon_momentum_int8``
(``DMuon(momentum_dtype=...)``, issue 51; only when named), ``adamw`` (``torch.optim.AdamW(foreach=True)``
on every parameter) and ``muon`` (``torch.optim.Muon`` on the 2-D hidden matrices, as
DTensors, beside ``torch.optim.AdamW(foreach=True)`` for the rest: embeddings, output, norms
and, in the MoE model, the 3-D expert stacks, which ``torch.optim.Muon`` refuses).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon import DMuon
from dmuon.tools import TorchDispatchMode

OPTIMIZERS = ("dmuon", "dmuon_foreach", "adamw", "muon", "dmuon_capturable")
# DMuon() with its momentum kept in bf16 or int8 (issue 51): asked for by name, not in the default set.
MOMENTUM_ROWS = {"dmuon_momentum_bf16": "bfloat16", "dmuon_momentum_int8": "int8"}
RANKS = (1, 2, 4)
# Issue 25's acceptance: the most aten ops DMuon(foreach=True) may take per step on the
# busiest rank, by (model, P). Issue 31's: its step time over AdamW(foreach=True)'s at
# P = 2, to be read with ``--ns-dtype float32`` (issue 25 asked for 3.5x).
# Issue 40's exact masks add one select per momentum buffer and per AdamW tensor on the CPU
# (a select keeps a masked tensor's bits, NaN included; on the CPU a ``torch.where`` per
# tensor is cheaper than a list op, which loops there; CUDA runs them as list ops,
# docs/dry_run.md): issue 25's 3,000 and 1,500 become 3,600 and 2,200 (measured: 3,150 and
# 1,955 with fp32 Newton-Schulz, 3,524 at P = 2 with bf16 on an AMX CPU).
ACCEPTANCE_OPS = {("llama3_8b", 2): 3600, ("llama3_8b", 4): 2200}
ACCEPTANCE_TIME_RATIO = 2.4
# Timed rounds by default: enough that the median steps over the bursts of a shared VM.
STEPS = 20
LR = 0.02
# Tiny widths: llama3's proportions (GQA with a quarter of the heads' width for keys and
# values, an FFN 3.5x wide) at width 32, so Newton-Schulz of one matrix is microseconds.
DIM = 32
KV_DIM = DIM // 4
HIDDEN = 112
VOCAB = 128
EXPERTS = 8


@dataclass(frozen=True)
class ModelShape:
    """A model's parameter structure: ``blocks`` transformer blocks, each an attention
    (wq wk wv wo), two norms, and either a dense SwiGLU FFN (w1 w2 w3) or ``experts``
    3-D expert stacks with a router; plus embeddings, a final norm and the output."""

    name: str
    blocks: int
    experts: int = 0

    @property
    def num_params(self) -> int:
        return self.blocks * (9 + (1 if self.experts else 0)) + 3


MODELS = {
    "llama3_8b": ModelShape("llama3_8b", 32),
    "llama3_70b": ModelShape("llama3_70b", 80),
    "moe": ModelShape("moe", 16, EXPERTS),
}


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)


class _Experts(nn.Module):
    """TorchTitan's grouped experts: one ``[E, out, in]`` stack per projection."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, HIDDEN, DIM) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, DIM, HIDDEN) * HIDDEN**-0.5)
        self.w3 = nn.Parameter(torch.randn(experts, HIDDEN, DIM) * DIM**-0.5)


class _MoE(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = _Experts(experts)


class _Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.attention = _Attention()
        self.attention_norm = nn.RMSNorm(DIM)
        self.ffn_norm = nn.RMSNorm(DIM)
        if experts:
            self.moe = _MoE(experts)
        else:
            self.feed_forward = _FeedForward()


class _Model(nn.Module):
    """Parameter names as TorchTitan's llama3 has them, so DMuon's default routing sends
    ``tok_embeddings`` and ``output`` to AdamW."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_Block(shape.experts) for _ in range(shape.blocks))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)


def build_model(shape: ModelShape) -> _Model:
    """The model, ``fully_shard``-ed block by block and at the root on all ranks."""
    torch.manual_seed(0)
    model = _Model(shape)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_grads(model: nn.Module) -> list[torch.Tensor]:
    """Deterministic grads laid out like the parameters (a scaled copy of each)."""
    return [p.detach() * 0.01 + 0.001 for p in model.parameters()]


def make_optimizers(name: str, model: nn.Module, ns_dtype: str = "auto") -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    if name == "dmuon":
        return [DMuon(named, lr=LR, ns_dtype=ns_dtype)]
    if name == "dmuon_foreach":
        return [DMuon(named, lr=LR, foreach=True, ns_dtype=ns_dtype)]
    if name == "dmuon_capturable":  # lr and weight_decay as device tensors (torch's default foreach)
        return [DMuon(named, lr=LR, capturable=True, ns_dtype=ns_dtype)]
    if name in MOMENTUM_ROWS:
        return [DMuon(named, lr=LR, ns_dtype=ns_dtype, momentum_dtype=MOMENTUM_ROWS[name])]
    if name == "adamw":
        return [torch.optim.AdamW([p for _, p in named], lr=LR, foreach=True)]
    if name == "muon":
        hidden = [p for n, p in named if p.ndim == 2 and not n.startswith(("tok_embeddings.", "output."))]
        rest = [p for n, p in named if not any(p is h for h in hidden)]
        return [torch.optim.Muon(hidden, lr=LR), torch.optim.AdamW(rest, lr=LR, foreach=True)]
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS + tuple(MOMENTUM_ROWS)}")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Row:
    """One optimizer on one model at one world size."""

    model: str
    world_size: int
    optimizer: str
    host_ms: float
    ops: int
    top_ops: dict[str, int] = field(default_factory=dict)


def measure(steps_by_name: dict[str, Callable[[], None]], steps: int, warmup: int
            ) -> dict[str, tuple[float, collections.Counter[str]]]:
    """Each optimizer's median over ``steps`` timed steps of the slowest rank's step time
    (ms), and this rank's op counts of one more step. The optimizers take turns, one
    step each per round, so a slow spell of the machine (a shared 2-core VM has them)
    falls on all of them alike instead of on whichever ran then: their ratio is what
    one run can quote."""
    times: dict[str, list[float]] = {name: [] for name in steps_by_name}
    for i in range(warmup + steps):
        for name, step in steps_by_name.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times[name].append(elapsed.item() * 1e3)
    results = {}
    for name, step in steps_by_name.items():
        counter = OpCounter()
        with counter:
            step()
        results[name] = (statistics.median(times[name]), counter.counts)
    return results


def run_rows(shape: ModelShape, optimizers: Sequence[str], steps: int, warmup: int, ns_dtype: str) -> list[Row]:
    """Every optimizer on ``shape`` on this group's ranks (the same rows on every rank),
    each with its own copy of the model, timed in turns (:func:`measure`)."""
    steps_by_name = {}
    for name in optimizers:
        model = build_model(shape)
        params = list(model.parameters())
        steps_by_name[name] = _stepper(params, make_grads(model), make_optimizers(name, model, ns_dtype))
    rows = []
    for name, (host_ms, counts) in measure(steps_by_name, steps, warmup).items():
        totals = [None] * dist.get_world_size()
        dist.all_gather_object(totals, (sum(counts.values()), dict(counts.most_common(12))))
        ops, top = max(totals, key=lambda t: t[0])
        rows.append(Row(shape.name, dist.get_world_size(), name, host_ms, ops, top))
    return rows


def _stepper(params: list[torch.Tensor], grads: list[torch.Tensor], optimizers: list[torch.optim.Optimizer]
             ) -> Callable[[], None]:
    """One training step's optimizer work: the grads set, then every optimizer stepped."""
    def step() -> None:
        for param, grad in zip(params, grads):
            param.grad = grad
        for optimizer in optimizers:
            optimizer.step()
    return step


def measure_rows(models: Sequence[str], optimizers: Sequence[str], steps: int, warmup: int,
                 ns_dtype: str = "auto") -> list[Row]:
    """Every model and optimizer on this process group's ranks (one thread each)."""
    torch.set_num_threads(1)
    return [row for model in models for row in run_rows(MODELS[model], optimizers, steps, warmup, ns_dtype)]


def _worker(rank: int, world_size: int, port: int, models: Sequence[str], optimizers: Sequence[str], steps: int,
            warmup: int, ns_dtype: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        rows = measure_rows(models, optimizers, steps, warmup, ns_dtype)
        if rank == 0:
            with open(out, "w") as f:
                json.dump([asdict(row) for row in rows], f)
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, models: Sequence[str], optimizers: Sequence[str], steps: int,
                 warmup: int, ns_dtype: str = "auto") -> list[Row]:
    """Start ``world_size`` gloo ranks (spawned processes) and return rank 0's rows."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        torch_mp.start_processes(_worker, args=(world_size, port, models, optimizers, steps, warmup, ns_dtype, out),
                                 nprocs=world_size, join=True, start_method="spawn")
        with open(out) as f:
            return [Row(**row) for row in json.load(f)]


def format_table(rows: Sequence[Row]) -> str:
    lines = [f"{'model':<12}{'P':>3}  {'optimizer':<15}{'host ms':>9}{'ops/step':>10}  most frequent ops"]
    for row in rows:
        top = ", ".join(f"{op} {n}" for op, n in list(row.top_ops.items())[:6])
        lines.append(f"{row.model:<12}{row.world_size:>3}  {row.optimizer:<15}{row.host_ms:>9.1f}{row.ops:>10,}  {top}")
    return "\n".join(lines)


def acceptance(rows: Sequence[Row]) -> list[str]:
    """The issue's acceptance checks that ``rows`` allow, one line each."""
    by_key = {(r.model, r.world_size, r.optimizer): r for r in rows}
    lines = []
    for (model, world), limit in ACCEPTANCE_OPS.items():
        if (row := by_key.get((model, world, "dmuon_foreach"))) is not None:
            verdict = "ok" if row.ops <= limit else "OVER"
            lines.append(f"{model} P={world}: dmuon_foreach {row.ops:,} ops <= {limit:,}: {verdict}")
    dmuon, adamw = by_key.get(("llama3_8b", 2, "dmuon_foreach")), by_key.get(("llama3_8b", 2, "adamw"))
    if dmuon is not None and adamw is not None:
        ratio = dmuon.host_ms / adamw.host_ms
        verdict = "ok" if ratio <= ACCEPTANCE_TIME_RATIO else "OVER"
        lines.append(f"llama3_8b P=2: dmuon_foreach / adamw time {ratio:.2f}x <= {ACCEPTANCE_TIME_RATIO}x: {verdict}")
    blocks = {(r.model, r.world_size): r.ops / MODELS[r.model].blocks for r in rows if r.optimizer == "dmuon_foreach"}
    for (model, world), per_block in sorted(blocks.items()):
        if model == "llama3_70b" and ("llama3_8b", world) in blocks:
            verdict = "ok" if per_block <= blocks[("llama3_8b", world)] else "OVER"
            lines.append(f"P={world}: dmuon_foreach ops per block, 70B {per_block:.1f} <= 8B "
                         f"{blocks[('llama3_8b', world)]:.1f}: {verdict}")
    return lines


def plot_rows(rows: Sequence[Row], path: str) -> None:
    """Ops per step and host ms against P, one line per optimizer, one panel pair per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row.model for row in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 6.4), squeeze=False)
    for column, model in enumerate(models):
        for name in dict.fromkeys(row.optimizer for row in rows):
            mine = sorted((r for r in rows if r.model == model and r.optimizer == name), key=lambda r: r.world_size)
            ranks = [r.world_size for r in mine]
            axes[0][column].plot(ranks, [r.ops for r in mine], marker="o", label=name)
            axes[1][column].plot(ranks, [r.host_ms for r in mine], marker="o", label=name)
        axes[0][column].set_title(f"{model} ({MODELS[model].num_params} parameters)", fontsize=10)
        axes[0][column].set_ylabel("aten ops / step, busiest rank")
        axes[1][column].set_ylabel("host ms / step, slowest rank")
        for axis in axes[:, column]:
            axis.set_xlabel("P (gloo ranks)")
            axis.set_xticks(sorted({r.world_size for r in rows}))
            axis.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"benchmarks.host_overhead: {_cpu_name()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu_name() -> str:
    return f"CPU ({os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of %(default)s")
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)), help="world sizes (default %(default)s)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of %(default)s")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default %(default)s)")
    parser.add_argument("--ns-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="the DMuon rows' ns_dtype (default auto: bf16 on a CPU with a bf16 matmul, whose "
                             "per-call cost on tiny matrices is several times fp32's)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    parser.add_argument("--plot", default=None, help="write a PNG plot to this path (needs matplotlib)")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    for chosen, known, what in ((args.models, MODELS, "model"),
                                (args.optimizers, OPTIMIZERS + tuple(MOMENTUM_ROWS), "optimizer")):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"unknown {what}(s) {unknown}; choose from {list(known)}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    rows = [row for world in args.ranks
            for row in run_on_ranks(world, args.models, args.optimizers, args.steps, args.warmup, args.ns_dtype)]
    rows.sort(key=lambda r: (args.models.index(r.model), r.world_size))
    print(f"benchmarks.host_overhead: {_cpu_name()}, one thread per rank, widths {DIM}/{HIDDEN}, "
          f"DMuon ns_dtype {args.ns_dtype}")
    print(format_table(rows), flush=True)
    for line in acceptance(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu_name(), "ns_dtype": args.ns_dtype, "rows": [asdict(row) for row in rows]}, f,
                      indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot_rows(rows, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print(f"no plot: matplotlib is not installed (pip install matplotlib), {args.plot} not written")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
