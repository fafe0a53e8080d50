"""QK-clip (the "Clip" of MuonClip, Kimi K2, arXiv 2507.20534, section 2.1) as pure functions
of tensors: no optimizer, no process groups.

After an optimizer step, every attention head ``h`` whose largest pre-softmax logit in the
step's forward passes, ``S_h = max_ij (q_i . k_j) * scale``, exceeded a threshold ``tau`` gets
its query and key projections shrunk by ``gamma_h = tau / S_h``, so that the same inputs would
now give a largest logit of ``tau``. Heads at or under ``tau`` are not touched at all (their
rows are not even multiplied by 1).

How ``gamma_h`` is shared between ``W_q`` and ``W_k`` depends on who owns the keys:

- multi-head attention (one key head per query head): ``sqrt(gamma_h)`` on the head's rows of
  ``W_q`` and of ``W_k``, as the report does for a head's own components;
- grouped-query / multi-query attention (a key head shared by several query heads): ``gamma_h``
  on the query rows only, ``W_k`` untouched. A shared key head cannot take a factor without
  changing the logits of the other heads of its group, and the report leaves shared components
  alone for the same reason (MLA's shared rotary key ``k_R``). The clipped head's logit still
  lands exactly on ``tau``.
- MLA (DeepSeek-V3, Kimi K2 itself) splits each head into a head-specific part (``q_C``,
  ``k_C``: ``sqrt(gamma_h)`` each) and a rotary part whose key is shared (``q_R``: ``gamma_h``,
  ``k_R``: untouched). dmuon does not implement MLA's row map; ``dmuon.attention.clipping``
  refuses layouts it does not know.

Rows are scaled in float32 and rounded once to the weight's dtype, elementwise, so the result
does not depend on which rank holds which rows: bitwise equal to a single process whatever
the sharding."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Bounds the logits of one chunk of queries, ``[batch, heads, chunk, keys]`` in the
# activations' dtype (64 MiB): a chunk holds as many queries as fit, at least one.
DEFAULT_LOGIT_SCRATCH_BYTES = 64 * 2**20

# ``mask_mod(b, h, q_idx, kv_idx) -> bool``, FlexAttention's convention: True where the query
# may attend to the key. Called with broadcastable index tensors.
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# How an attention's query and key rows sit in its weights.
SEPARATE = "separate"  # ``W_q`` ``[n_heads * head_dim, dim]`` and ``W_k`` ``[n_kv_heads * head_dim, dim]``
FUSED_GROUPED = "fused_grouped"  # one ``W_qkv``: per key head, its query heads' rows, then its k rows, then its v rows
ROW_LAYOUTS = (SEPARATE, FUSED_GROUPED)


@dataclass(frozen=True)
class AttentionHeads:
    """The head structure of one attention's projections; ``row_layout``: :data:`SEPARATE`
    (``wq`` and ``wk``, TorchTitan 0.2's and most models') or :data:`FUSED_GROUPED` (TorchTitan
    0.3's ``wqkv``)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    row_layout: str = SEPARATE

    def __post_init__(self) -> None:
        for name in ("n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AttentionHeads: {name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"AttentionHeads: n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.row_layout not in ROW_LAYOUTS:
            raise ValueError(f"AttentionHeads: unknown row_layout {self.row_layout!r}; use one of {ROW_LAYOUTS}")

    @property
    def shares_keys(self) -> bool:
        """GQA / MQA: several query heads read one key head."""
        return self.n_heads > self.n_kv_heads

    def weight_rows(self) -> tuple[int, int]:
        """Rows of ``(W_q, W_k)``; for the fused layout both are ``W_qkv``'s."""
        if self.row_layout == FUSED_GROUPED:
            rows = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
            return rows, rows
        return self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None, causal: bool = True,
                    mask_mod: MaskMod | None = None, scratch_bytes: int = DEFAULT_LOGIT_SCRATCH_BYTES) -> torch.Tensor:
    """The largest attention logit of each query head, ``max (q_i . k_j) * scale`` over batch,
    queries and the keys each query may see; float32, ``[n_query_heads]``.

    ``q``: ``[batch, n_heads, seq_q, head_dim]``; ``k``: ``[batch, n_kv_heads, seq_k, head_dim]``
    (SDPA's layout; ``n_heads`` a multiple of ``n_kv_heads``: query head ``h`` reads key head
    ``h // (n_heads / n_kv_heads)``). ``scale`` defaults to ``head_dim ** -0.5``. ``causal``: key
    ``j`` visible to query ``i`` only if ``j <= i``; ``mask_mod`` (FlexAttention's, e.g. a
    document mask) narrows further. A head that sees no key gets ``-inf``.

    Computed chunk by chunk of queries in the activations' dtype, without autograd, so the
    scratch stays under ``scratch_bytes`` (the cost is one extra ``q @ k^T``)."""
    batch, n_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    if n_heads % n_kv_heads:
        raise ValueError(f"head_max_logits: {n_heads} query heads do not group over {n_kv_heads} key heads")
    group = n_heads // n_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    per_query = batch * n_heads * seq_k * q.element_size()
    chunk = max(1, min(seq_q, scratch_bytes // max(1, per_query)))
    keys_t = k.transpose(-1, -2)  # [b, kv, d, s_k]
    best = torch.full((n_heads,), -math.inf, dtype=torch.float32, device=q.device)
    key_idx = torch.arange(seq_k, device=q.device)
    for start in range(0, seq_q, chunk):
        stop = min(seq_q, start + chunk)
        # [b, kv, group * c, d] @ [b, kv, d, s_k]: each key head once, for its query heads.
        # Causal: the chunk's queries see keys up to ``stop - 1`` only; skip the rest.
        keys = stop if causal else seq_k
        queries = q[:, :, start:stop].reshape(batch, n_kv_heads, group * (stop - start), head_dim)
        logits = torch.matmul(queries, keys_t[..., :keys]).view(batch, n_heads, stop - start, keys)
        query_idx = torch.arange(start, stop, device=q.device)
        visible = _visible(batch, n_heads, query_idx, key_idx[:keys], causal, mask_mod)
        if visible is not None:
            logits.masked_fill_(~visible, -math.inf)  # in place: the matmul's output is ours
        best = torch.maximum(best, logits.amax(dim=(0, 2, 3)).float())
    # The scale is positive: scaling the maximum is scaling every logit, and cheaper.
    return best * scale


def _visible(batch: int, n_heads: int, query_idx: torch.Tensor, key_idx: torch.Tensor, causal: bool,
             mask_mod: MaskMod | None) -> torch.Tensor | None:
    """Which (batch, head, query, key) pairs count, broadcastable to the logits; None: all."""
    visible = key_idx[None, :] <= query_idx[:, None] if causal else None
    if mask_mod is not None:
        b = torch.arange(batch, device=query_idx.device).view(-1, 1, 1, 1)
        h = torch.arange(n_heads, device=query_idx.device).view(1, -1, 1, 1)
        by_mod = mask_mod(b, h, query_idx.view(1, 1, -1, 1), key_idx.view(1, 1, 1, -1))
        visible = by_mod if visible is None else visible & by_mod
    return visible


def clip_factors(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """``gamma_h = threshold / S_h`` for heads over the threshold, 1 elsewhere (also for a head
    with no finite logit: nothing to say about it), float32."""
    max_logits = max_logits.float()
    over = torch.isfinite(max_logits) & (max_logits > threshold)
    return torch.where(over, threshold / max_logits, torch.ones_like(max_logits))


def row_scales(heads: AttentionHeads, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row factors of ``(W_q, W_k)`` for the per-head ``gamma`` (float32, one per row of
    each weight, ``heads.weight_rows()``): the module docstring's rule. In the fused layout
    both are factors of ``W_qkv``'s rows, to be multiplied together."""
    gamma = gamma.float()
    if heads.shares_keys:
        q_head, k_head = gamma, torch.ones(heads.n_kv_heads, dtype=torch.float32, device=gamma.device)
    else:
        q_head = k_head = gamma.sqrt()
    q_rows = q_head.repeat_interleave(heads.head_dim)
    k_rows = k_head.repeat_interleave(heads.head_dim)
    if heads.row_layout == SEPARATE:
        return q_rows, k_rows
    # Fused: per key head g, [its query heads' rows | its k rows | its v rows].
    group_rows = (heads.n_heads // heads.n_kv_heads) * heads.head_dim
    ones = torch.ones(heads.n_kv_heads, heads.head_dim, dtype=torch.float32, device=gamma.device)
    q_fused = torch.cat([q_rows.view(heads.n_kv_heads, group_rows), ones, ones], dim=1).flatten()
    k_fused = torch.cat([torch.ones(heads.n_kv_heads, group_rows, dtype=torch.float32, device=gamma.device),
                         k_rows.view(heads.n_kv_heads, heads.head_dim), ones], dim=1).flatten()
    return q_fused, k_fused


@torch.no_grad()
def scale_rows_(local: torch.Tensor, rows: Sequence[tuple[int, int]], factors: torch.Tensor) -> None:
    """Multiply each row of ``local`` by its factor, in float32, rounding once to ``local``'s dtype.

    ``local`` holds the global rows ``rows`` (``(start, length)`` ranges, concatenated in order,
    as ``dmuon.plan.layout.local_indices`` gives them); ``factors`` has one entry per global row.
    A row whose factor is 1 keeps its bits (``x * 1.0`` is ``x`` in IEEE arithmetic, and the
    round trip through float32 is exact), so no host sync is needed to find the clipped rows."""
    if local.numel() == 0:
        return
    index = torch.cat([torch.arange(start, start + length, device=local.device) for start, length in rows])
    mine = factors.to(local.device)[index].view(-1, *([1] * (local.dim() - 1)))
    local.copy_((local.float() * mine).to(local.dtype))
