"""What the TorchTitan 0.3.x tests share: the skip beside other releases, and toy
models whose parameter names and attention attributes are 0.3's llama3's.

The toys are a few kB, so that unit tests stay fast; the real 0.3 debug model is
built where a test needs TorchTitan's own modules or parallelize function.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

DIM, HEAD_DIM, VOCAB, HIDDEN = 32, 8, 64, 48


def require_titan03() -> None:
    """Skip the calling test module unless TorchTitan 0.3.x is installed (the main
    suite runs beside 0.2.x)."""
    pytest.importorskip("torchtitan")
    from torchtitan_ext.versions import torchtitan_line

    if torchtitan_line() != "0.3":
        pytest.skip("needs TorchTitan 0.3.x", allow_module_level=True)


class FusedQKV(nn.Module):
    """Like TorchTitan 0.3's ``FusedQKVLinear``: ``head_dim`` and a fused ``wqkv``."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HEAD_DIM
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_linear = FusedQKV()
        self.wo = nn.Linear(DIM, DIM, bias=False)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(DIM)
        self.ffn_norm = nn.RMSNorm(DIM)


class ToyLlama3(nn.Module):
    """A pipeline stage of a 0.3-style llama3: layers ``layer_ids``, with the token
    embeddings if ``first`` and the final norm and ``lm_head`` if ``last``."""

    def __init__(self, layer_ids: tuple[int, ...] = (0, 1), first: bool = True, last: bool = True,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM) if first else None
        self.layers = nn.ModuleDict({str(i): Block() for i in layer_ids})
        self.norm = nn.RMSNorm(DIM) if last else None
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False) if last else None
        with torch.no_grad():  # norms start at 1; make them differ so a change shows
            for name, param in self.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)


def two_stages(seed: int = 0) -> list[nn.Module]:
    """Two model parts, as pipeline parallelism gives one rank with two stages."""
    return [ToyLlama3((0,), first=True, last=False, seed=seed), ToyLlama3((1,), first=False, last=True, seed=seed + 1)]


def set_grads(model_parts: list[nn.Module], seed: int) -> None:
    """A reproducible gradient for every parameter."""
    generator = torch.Generator().manual_seed(seed)
    for model in model_parts:
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)


def llama3_dmuon():
    """A config function (``--module tests.titan03_support --config llama3_dmuon``):
    TorchTitan's llama3 debug recipe with DMuon."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan_ext.titan03.optimizer import dmuon_optimizer

    config = llama3_debugmodel()
    config.optimizer = dmuon_optimizer(lr=0.02, weight_decay=0.1)
    return config


# Every block of the debug MoE model is parallelized alike; 2 of its 8 make a CPU step about
# 4x cheaper (scripts/show_layouts_titan03.py --layers cuts it the same way).
MOE_DEBUG_LAYERS = 2


def qwen3_moe_debug_cpu():
    """A config function: ``torchtitan_ext.titan03.configs.llama3_debug_cpu`` with
    qwen3's MoE debug model (64 experts, vocab 2048 like the embedded tokenizer) cut to
    its first ``MOE_DEBUG_LAYERS`` blocks, for expert parallelism on CPU ranks."""
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.qwen3 import model_registry

    from torchtitan_ext.titan03.configs import cpu_ready, llama3_debug_cpu

    config = llama3_debug_cpu()
    config.model_spec = cpu_ready(model_registry("debugmodel_moe"))
    config.model_spec.model.layers = config.model_spec.model.layers[:MOE_DEBUG_LAYERS]
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    # TorchTitan refuses EP's all-to-all token dispatcher under CUDA graphs (on by
    # default); a CPU run has none to disable, but the check runs at parse time.
    config.training.disable_cuda_graphs = True
    return config
