"""Per-document causal attention with a CPU backward, for TorchTitan 0.3 language models.

Why this exists: TorchTitan 0.3's language models accept only ``flex``, ``flex_flash`` or
``varlen`` inner attention, because its dataloaders pack several documents into each
sequence and mark where each starts (``positions`` resets to 0). ``flex_attention`` has no
backward on CPU (torch 2.15: "FlexAttention does not support backward on CPU") and
``varlen_attn`` is a CUDA flash kernel, so none of them can train on a CPU-only machine.

What it computes: the mask TorchTitan builds for FlexAttention
(``Decoder._create_flex_attention_mask_for_document``): query ``i`` sees key ``j`` when
``j <= i`` and both lie in the same document of the same sequence, a document starting
wherever ``positions`` is 0. Grouped-query attention (fewer key/value heads) is supported.

How it plugs in, without patching TorchTitan: its ``Config`` subclasses
``VarlenAttention.Config``. TorchTitan decides which masks to build from the inner
attention's config type, so a model using this config gets ``VarlenMetadata`` (the
packed document boundaries ``cu_seq_q``, computed by TorchTitan from ``positions`` with
plain tensor ops that run on CPU), and this module turns those boundaries back into the
per-sequence block-causal mask. ``cpu_attention_config`` and
``use_cpu_attention_without_accelerator`` put it into a model config.

How it computes: one ``F.scaled_dot_product_attention`` call with a boolean mask. On CPU
that dispatches to the fused (flash-style) kernel, which keeps only a log-sum-exp per row
for the backward rather than the ``L x L`` probabilities per head, so memory is the
``B x L x L`` boolean mask (shared by all heads and, via a one-entry cache, all layers of
one forward) plus the usual activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
from torchtitan.protocols.module import Module

# The only window this attention implements: unlimited look-back, no look-ahead (causal).
CAUSAL_WINDOW = (-1, 0)


def document_ids_from_boundaries(cu_seq: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """Document index of every token, shape ``(batch, seq_len)``, from packed boundaries.

    ``cu_seq`` holds the start offsets of every document in the ``batch * seq_len`` packed
    tokens, then the total. TorchTitan's dataloaders start every sequence with a new
    document (they renumber a continued document's positions from 0), so every row start
    ``b * seq_len`` is a boundary; a row that does not start one would let a document run
    across two sequences, which FlexAttention's mask does not allow, so it is refused.
    """
    starts = cu_seq[:-1].to(torch.long)
    row_starts = torch.arange(batch, device=cu_seq.device, dtype=torch.long) * seq_len
    # Checked in eager only: a graph torch.compile traces cannot branch on a tensor's value
    # (under TorchTitan's fullgraph=True that is an error), and TorchTitan's own mask
    # builder starts every row with a document (the eager runs check that it does).
    if not torch.compiler.is_compiling() and not bool(torch.isin(row_starts, starts).all()):
        raise ValueError(
            "every sequence must start a document (positions[:, 0] == 0); "
            f"document starts {starts.tolist()} miss a row start of {row_starts.tolist()}"
        )
    token = torch.arange(batch * seq_len, device=cu_seq.device, dtype=torch.long)
    # The document of token t is the last start <= t.
    doc = torch.searchsorted(starts, token, right=True) - 1
    return doc.view(batch, seq_len)


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``(B, 1, L, L)``: True where query ``i`` may attend to key ``j``
    (``j <= i`` and the same document)."""
    seq_len = doc_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)
    return (same_doc & causal).unsqueeze(1)


def block_causal_attention(
    q_BLNH: torch.Tensor,
    k_BLNH: torch.Tensor,
    v_BLNH: torch.Tensor,
    mask_B1LL: torch.Tensor,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Masked attention in TorchTitan's ``(batch, seq, heads, head_dim)`` layout."""
    q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask_B1LL, scale=scale, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2)


class CpuBlockCausalAttention(Module):
    """Drop-in inner attention for CPU training; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        """A ``VarlenAttention.Config`` so TorchTitan hands this module document
        boundaries (``VarlenMetadata``); ``window_size`` must stay causal."""

    # One forward passes the same VarlenMetadata object to every layer: build its mask once.
    _cached_mask: tuple[VarlenMetadata, torch.Tensor] | None = None

    def __init__(self, config: Config) -> None:
        super().__init__()
        if tuple(config.window_size) != CAUSAL_WINDOW:
            raise ValueError(
                f"CpuBlockCausalAttention implements only causal attention (window_size "
                f"{CAUSAL_WINDOW}), got {config.window_size}"
            )

    @classmethod
    def _mask_for(cls, masks: VarlenMetadata, batch: int, seq_len: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Compiled (per block): no cache. Dynamo would guard on the cached masks' identity,
            # new every forward, and recompile each time; the mask is cheap next to the block.
            return block_causal_mask(document_ids_from_boundaries(masks.cu_seq_q, batch, seq_len))
        cached = cls._cached_mask
        if cached is not None and cached[0] is masks and cached[1].shape == (batch, 1, seq_len, seq_len):
            return cached[1]
        mask = block_causal_mask(document_ids_from_boundaries(masks.cu_seq_q, batch, seq_len))
        cls._cached_mask = (masks, mask)
        return mask

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: VarlenMetadata,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(
                "CpuBlockCausalAttention needs the VarlenMetadata TorchTitan builds for a "
                f"VarlenAttention.Config, got {type(attention_masks).__name__}"
            )
        if out_transform is not None:
            raise NotImplementedError("CpuBlockCausalAttention does not return the log-sum-exp")
        batch, seq_len = q_BLNH.shape[:2]
        mask = self._mask_for(attention_masks, batch, seq_len)
        return block_causal_attention(
            q_BLNH, k_BLNH, v_BLNH, mask, scale=scale, enable_gqa=enable_gqa
        )


def has_accelerator() -> bool:
    """True when torch sees a GPU or other accelerator this process could train on."""
    return torch.accelerator.is_available()


def _check_standard_masks(model_config: Any) -> None:
    """Refuse a model that builds its own attention masks (sliding windows, ...).

    ``CpuBlockCausalAttention`` reproduces ``Decoder.get_attention_masks``'s mask; a model
    class that overrides it (gpt_oss, qwen3_5, muse_glimmer in 0.3.0) may mean another.
    """
    from torchtitan.models.common.decoder import Decoder

    model_cls = getattr(model_config, "_owner", None)
    if model_cls is None or not issubclass(model_cls, Decoder):
        raise TypeError(f"use_cpu_attention needs a Decoder model config, got {type(model_config).__qualname__}")
    if model_cls.get_attention_masks is not Decoder.get_attention_masks:
        raise NotImplementedError(
            f"{model_cls.__name__} builds its own attention masks; CpuBlockCausalAttention only "
            "reproduces Decoder's per-document causal mask"
        )


def use_cpu_attention(model_config: Any) -> int:
    """Replace every Flex/Varlen inner attention in ``model_config`` (in place) by
    ``CpuBlockCausalAttention.Config``; return how many were replaced.

    Only for models that use ``Decoder``'s own per-document causal mask (llama3, qwen3).
    """
    from torchtitan.models.common.attention import FlexAttention

    _check_standard_masks(model_config)
    replaced = 0
    for kind in (FlexAttention.Config, VarlenAttention.Config):
        for _fqn, cfg, parent, attr in list(model_config.traverse(kind)):
            if isinstance(cfg, CpuBlockCausalAttention.Config) or parent is None:
                continue
            window = getattr(cfg, "window_size", CAUSAL_WINDOW)
            new = CpuBlockCausalAttention.Config(window_size=window)
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            replaced += 1
    return replaced


def use_cpu_attention_without_accelerator(model_config: Any) -> bool:
    """``use_cpu_attention`` only on a machine without an accelerator; True if it ran.

    With a GPU the model keeps TorchTitan's own (faster) kernels.
    """
    if has_accelerator():
        return False
    use_cpu_attention(model_config)
    return True
