"""The models a dry run steps: the parameter structure of real ones, built as modules.

A preset gives the shapes; :func:`build` makes an ``nn.Module`` with TorchTitan's
parameter names (``layers.N.attention.wq.weight``, ``tok_embeddings.weight``, ...), so
DMuon routes them as it would in a TorchTitan job: hidden matrices to Muon,
embeddings, output head and norms to AdamW. Built under a fake CUDA mode it costs no
memory at any size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dmuon.tools.plan_report import PRESETS as LLAMA3_SHAPES

# The head size of every preset (llama3's).
HEAD_DIM = 128


@dataclass(frozen=True)
class Preset:
    """The shapes of one model."""

    dim: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    layers: int
    vocab: int
    experts: int = 0
    """Routed experts per layer (0: a dense model); each a ``[experts, ffn, dim]`` stack."""
    head_dim: int = HEAD_DIM


def _llama3(name: str) -> Preset:
    shapes = LLAMA3_SHAPES[name]
    return Preset(dim=shapes.dim, ffn=shapes.ffn, n_heads=shapes.dim // HEAD_DIM, n_kv_heads=shapes.kv // HEAD_DIM,
                  layers=shapes.layers, vocab=shapes.vocab)


PRESETS: dict[str, Preset] = {
    "llama3-8b": _llama3("llama3-8b"),
    "llama3-70b": _llama3("llama3-70b"),
    "llama3-405b": _llama3("llama3-405b"),
    # A DeepSeek-V2-Lite-like MoE: 64 routed experts per layer, as 3-D stacks.
    "moe-16b": Preset(dim=2048, ffn=1408, n_heads=16, n_kv_heads=16, layers=26, vocab=102400, experts=64),
    # A small MoE for tests: 8 experts per layer.
    "moe-debug": Preset(dim=256, ffn=256, n_heads=16, n_kv_heads=16, layers=2, vocab=2048, experts=8, head_dim=16),
    # The CPU demo's model (TorchTitan's llama3 debugmodel: train_configs/llama3_debug_dmuon.toml).
    "debug": Preset(dim=256, ffn=768, n_heads=16, n_kv_heads=16, layers=6, vocab=2048, head_dim=16),
}


class RMSNormWeight(nn.Module):
    """A norm's parameters only (the dry run never runs a forward)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.wq = nn.Linear(p.dim, p.n_heads * p.head_dim, bias=False)
        self.wk = nn.Linear(p.dim, p.n_kv_heads * p.head_dim, bias=False)
        self.wv = nn.Linear(p.dim, p.n_kv_heads * p.head_dim, bias=False)
        self.wo = nn.Linear(p.n_heads * p.head_dim, p.dim, bias=False)


class FeedForward(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.w1 = nn.Linear(p.dim, p.ffn, bias=False)
        self.w2 = nn.Linear(p.ffn, p.dim, bias=False)
        self.w3 = nn.Linear(p.dim, p.ffn, bias=False)


class Experts(nn.Module):
    """Routed experts as TorchTitan's MoE holds them: one ``[E, out, in]`` stack per projection."""

    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(p.experts, p.ffn, p.dim))
        self.w2 = nn.Parameter(torch.empty(p.experts, p.dim, p.ffn))
        self.w3 = nn.Parameter(torch.empty(p.experts, p.ffn, p.dim))


class MoE(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.router = nn.Linear(p.dim, p.experts, bias=False)
        self.experts = Experts(p)


class Block(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.attention = Attention(p)
        self.attention_norm = RMSNormWeight(p.dim)
        if p.experts:
            self.moe = MoE(p)
        else:
            self.feed_forward = FeedForward(p)
        self.ffn_norm = RMSNormWeight(p.dim)


class Transformer(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(p.vocab, p.dim)
        self.layers = nn.ModuleList(Block(p) for _ in range(p.layers))
        self.norm = RMSNormWeight(p.dim)
        self.output = nn.Linear(p.dim, p.vocab, bias=False)


def build(preset: Preset, dtype: torch.dtype = torch.float32) -> Transformer:
    """The model, on the current default device (``torch.device("cuda")`` in a dry run),
    its parameters made in ``dtype`` (a fake tensor cannot be converted afterwards)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return Transformer(preset)
    finally:
        torch.set_default_dtype(default)
