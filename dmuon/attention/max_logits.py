"""Where a model reports its attention logits for QK-clip: a :class:`MaxLogitTracker` keeps, per
attention, the largest logit of each head seen by this rank since the optimizer last took them.

Local only: the tracker never communicates. ``DMuon`` takes the maxima at each ``step()`` and
reduces them with a MAX over the ranks of the attention weights' mesh
(``dmuon.attention.clipping``), which covers data-, context- and tensor-parallel ranks.

A model calls :meth:`MaxLogitTracker.observe` from its attention's forward, or from a forward
pre-hook on the module that receives ``q`` and ``k`` after the rotary embedding
(``torchtitan_ext`` installs such hooks on TorchTitan's models). Under tensor parallelism a
rank sees only its heads: ``head_offset`` places them among all heads.

Under ``torch.compile`` a model folds into a *slot* instead (:meth:`MaxLogitTracker.slot`,
:meth:`MaxLogitTracker.observe_into`): one persistent tensor per attention, made before the
first forward. ``observe`` looks its maxima up by name in a dict that grows during the forward;
traced, that is a guard on the name and on the dict's keys, so every attention (and every
microbatch) of a per-block compiled model recompiled the block, and TorchTitan's
``fullgraph=True`` made the ninth a hard error. ``observe_into`` reads no name and no dict:
each attention's hook holds its slot, every block traces the same ops, and one graph serves
them all. Slots and names meet in :meth:`MaxLogitTracker.take`."""

from __future__ import annotations

import math

import torch

from dmuon.attention.qk_clip import DEFAULT_LOGIT_SCRATCH_BYTES, MaskMod, head_max_logits


class MaxLogitTracker:
    """Running per-head maxima of attention logits, by attention name, on this rank."""

    def __init__(self, scratch_bytes: int = DEFAULT_LOGIT_SCRATCH_BYTES) -> None:
        self.scratch_bytes = scratch_bytes
        self._seen: dict[str, torch.Tensor] = {}
        self._slots: dict[str, torch.Tensor] = {}
        self.enabled = True  # False: observe returns at once (e.g. during evaluation: not the training step's logits)

    def observe(self, name: str, q: torch.Tensor, k: torch.Tensor, *, n_heads: int, head_offset: int = 0,
                scale: float | None = None, causal: bool = True, mask_mod: MaskMod | None = None) -> None:
        """Fold the logits of ``q`` and ``k`` (``[batch, heads, seq, head_dim]``, this rank's
        heads ``head_offset ..``) into attention ``name``'s maxima over its ``n_heads`` query
        heads; ``dmuon.attention.qk_clip.head_max_logits`` says the rest.

        Ignored with autograd off: evaluation runs under ``no_grad``, and its logits are not
        the training step's. (A forward recomputed by activation checkpointing is seen twice,
        which leaves the maxima unchanged.)"""
        if not self._counting():
            return
        _check_heads(f"attention {name!r}", q.shape[1], head_offset, n_heads)
        seen = self._seen.get(name)
        if seen is None or seen.numel() != n_heads:
            seen = self._seen[name] = torch.full((n_heads,), -math.inf, dtype=torch.float32, device=q.device)
        self._fold(seen, q, k, head_offset, scale, causal, mask_mod)

    def slot(self, name: str, n_heads: int, device: torch.device) -> torch.Tensor:
        """Attention ``name``'s slot for :meth:`observe_into`: its per-head maxima (float32,
        ``[n_heads]``, ``-inf`` where no logit was seen) in one tensor on ``device`` (where the
        attention's ``q`` lives) for the tracker's life. Made once, before the first forward;
        asking again returns the same tensor."""
        made = self._slots.get(name)
        if made is None:
            made = self._slots[name] = torch.full((n_heads,), -math.inf, dtype=torch.float32, device=device)
        elif made.numel() != n_heads:
            raise ValueError(f"MaxLogitTracker: attention {name!r} already has a slot of {made.numel()} heads, "
                             f"not {n_heads}")
        return made

    def observe_into(self, slot: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, head_offset: int = 0,
                     scale: float | None = None, causal: bool = True, mask_mod: MaskMod | None = None) -> None:
        """:meth:`observe` into an attention's ``slot`` (from :meth:`slot`), for code that
        ``torch.compile`` traces: it reads no name and no dict, only the slot, so every
        attention traces the same ops (no guard, no recompile), folded in place inside the
        graph (no graph break). Given the same ``q`` and ``k``, the same maxima as ``observe``,
        bit for bit (the same ops)."""
        if not self._counting():
            return
        _check_heads("a slot", q.shape[1], head_offset, slot.numel())
        self._fold(slot, q, k, head_offset, scale, causal, mask_mod)

    def _counting(self) -> bool:
        """Whether logits count now: not while disabled, nor with autograd off (:meth:`observe`)."""
        return self.enabled and torch.is_grad_enabled()

    def _fold(self, seen: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_offset: int, scale: float | None,
              causal: bool, mask_mod: MaskMod | None) -> None:
        """Fold the logits of ``q`` and ``k`` into ``seen`` (one attention's maxima) in place."""
        mine = head_max_logits(q.detach(), k.detach(), scale=scale, causal=causal, mask_mod=mask_mod,
                               scratch_bytes=self.scratch_bytes)
        part = seen[head_offset : head_offset + q.shape[1]]
        torch.maximum(part, mine.to(seen.device), out=part)

    def take(self, name: str, n_heads: int, device: torch.device) -> torch.Tensor:
        """Attention ``name``'s maxima since the last take (``-inf`` for heads not seen), from
        :meth:`observe` and its slot together, and forget them: the next step starts afresh
        (the slot is refilled with ``-inf`` in place, so a compiled forward keeps folding into
        the same tensor)."""
        seen = self._seen.pop(name, None)
        slot = self._slots.get(name)
        if slot is not None:
            from_slot = slot.clone()
            slot.fill_(-math.inf)
            seen = from_slot if seen is None else torch.maximum(seen.to(slot.device), from_slot)
        if seen is None:
            return torch.full((n_heads,), -math.inf, dtype=torch.float32, device=device)
        return seen.to(device)

    def clear(self) -> None:
        """Forget every maximum (e.g. after a step that was skipped)."""
        self._seen.clear()
        for slot in self._slots.values():
            slot.fill_(-math.inf)


def _check_heads(what: str, local_heads: int, head_offset: int, n_heads: int) -> None:
    """This rank's heads ``head_offset ..`` must lie among the attention's ``n_heads``."""
    if head_offset < 0 or head_offset + local_heads > n_heads:
        raise ValueError(f"MaxLogitTracker: {what}: heads {head_offset}..{head_offset + local_heads} "
                         f"do not fit in its {n_heads} heads; pass the rank's first head as head_offset")
