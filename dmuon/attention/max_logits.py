"""Where a model reports its attention logits for QK-clip: a :class:`MaxLogitTracker`
keeps, per attention, the largest logit of each head seen by this rank since the
optimizer last took them.

Local only: the tracker never communicates. ``DMuon`` takes the maxima at each
``step()`` and reduces them with a MAX over the ranks of the attention weights' mesh
(``dmuon.attention.clipping``), which covers data-, context- and tensor-parallel ranks.

A model calls :meth:`MaxLogitTracker.observe` from its attention's forward, or from a
forward pre-hook on the module that receives ``q`` and ``k`` after the rotary embedding
(``torchtitan_ext`` installs such hooks on TorchTitan's models). Under tensor
parallelism a rank sees only its heads: ``head_offset`` places them among all heads.
"""

from __future__ import annotations

import math

import torch

from dmuon.attention.qk_clip import DEFAULT_LOGIT_SCRATCH_BYTES, MaskMod, head_max_logits


class MaxLogitTracker:
    """Running per-head maxima of attention logits, by attention name, on this rank."""

    def __init__(self, scratch_bytes: int = DEFAULT_LOGIT_SCRATCH_BYTES) -> None:
        self.scratch_bytes = scratch_bytes
        self._seen: dict[str, torch.Tensor] = {}
        self.enabled = True
        """False: :meth:`observe` returns at once (e.g. during evaluation, whose logits
        are not the training step's)."""

    def observe(
        self,
        name: str,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        n_heads: int,
        head_offset: int = 0,
        scale: float | None = None,
        causal: bool = True,
        mask_mod: MaskMod | None = None,
    ) -> None:
        """Fold the logits of ``q`` and ``k`` (``[batch, heads, seq, head_dim]``, this
        rank's heads ``head_offset ..``) into attention ``name``'s maxima over its
        ``n_heads`` query heads; ``dmuon.attention.qk_clip.head_max_logits`` says the rest.

        Ignored with autograd off: evaluation runs under ``no_grad``, and its logits are
        not the training step's. (A forward recomputed by activation checkpointing is
        seen twice, which leaves the maxima unchanged.)"""
        if not self.enabled or not torch.is_grad_enabled():
            return
        local_heads = q.shape[1]
        if head_offset < 0 or head_offset + local_heads > n_heads:
            raise ValueError(f"MaxLogitTracker: attention {name!r}: heads {head_offset}..{head_offset + local_heads} "
                             f"do not fit in its {n_heads} heads; pass the rank's first head as head_offset")
        mine = head_max_logits(q.detach(), k.detach(), scale=scale, causal=causal, mask_mod=mask_mod,
                               scratch_bytes=self.scratch_bytes)
        seen = self._seen.get(name)
        if seen is None or seen.numel() != n_heads:
            seen = self._seen[name] = torch.full((n_heads,), -math.inf, dtype=torch.float32, device=q.device)
        part = seen[head_offset : head_offset + local_heads]
        torch.maximum(part, mine.to(seen.device), out=part)

    def has_seen(self, name: str) -> bool:
        """Whether attention ``name`` reported logits since the last take (a host fact:
        no device value is read)."""
        return name in self._seen

    def take(self, name: str, n_heads: int, device: torch.device) -> torch.Tensor:
        """Attention ``name``'s maxima since the last take (``-inf`` for heads not seen),
        and forget them: the next step starts afresh."""
        seen = self._seen.pop(name, None)
        if seen is None:
            return torch.full((n_heads,), -math.inf, dtype=torch.float32, device=device)
        return seen.to(device)

    def clear(self) -> None:
        """Forget every maximum (e.g. after a step that was skipped)."""
        self._seen.clear()
