"""What the step benchmark steps: its settings, its rows, the model and the gradients.

``BenchConfig`` holds one run's settings (``benchmarks.bench.parse_args`` fills it from
the command line); ``OPTIMIZERS`` are the rows, each an optimizer stepping the same
llama-like stack of matrices (``build_model``, parallelized per ``benchmarks.layouts``)
with the same gradients (``make_grads``). ``slow_bf16_rows`` says which rows a CPU
without a native bf16 matmul leaves out, and why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from benchmarks.layouts import like, parallelize
from dmuon.tools import DEFAULT_BATCH_NUMEL, DEFAULT_NS_ALGORITHM, DEFAULT_NS_DTYPE, native_bf16_matmul

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
    momentum_dtype: str | None = None
    """DMuon's momentum_dtype for the DMuon rows (None: the parameters' dtype)."""
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


def slow_bf16_rows(optimizers: tuple[str, ...], device_type: str, asked: bool) -> tuple[str, ...]:
    """The bf16 rows left out of this run, unless ``asked``: those of ``optimizers`` on a
    CPU without a native bf16 matmul, where their Newton-Schulz alone takes minutes a step."""
    if asked or native_bf16_matmul(device_type):
        return ()
    return tuple(name for name in optimizers if name in BF16_ROWS)


# Why slow_bf16_rows leaves rows out, as the output says it.
SLOW_BF16_REASON = (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16 matmul, so their bf16 "
                    "Newton-Schulz runs ~50x slower than fp32 (minutes a step); pass --bf16-rows to run them "
                    "(the like-for-like comparison with torch.optim.Muon)")
