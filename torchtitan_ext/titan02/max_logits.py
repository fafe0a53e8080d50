"""QK-clip for TorchTitan 0.2.x models: report each attention's logits to ``DMuon`` and
register its ``W_q``/``W_k`` for clipping (0.3.x's attentions differ, and have their own
module: ``torchtitan_ext/titan03/max_logits.py``).

TorchTitan 0.2's attentions (llama3, llama4, qwen3, deepseek_v3, gpt_oss) all hand
``q``, ``k``, ``v`` -- after the rotary embedding, ``[batch, heads, seq, head_dim]`` --
to a child module named ``inner_attention`` (SDPA, FlexAttention or varlen wrapper).
A forward pre-hook on that child therefore sees exactly the ``q`` and ``k`` whose
products are the logits, without copying or editing TorchTitan's ``forward``. The hook
only measures (``DMuon.max_logits.observe_into``: per-head maxima, bounded scratch); the
clip itself happens in ``DMuon.step`` (``dmuon.attention.clipping``).

Under ``[compile] enable`` TorchTitan compiles each transformer block with
``fullgraph=True`` before the optimizer (and so these hooks) exists; Dynamo then traces
the hook into every block's graph. So the hook folds into the attention's *slot*
(``torchtitan_ext/logit_slots.py``) and reads no per-attention string: all blocks trace
the same ops, and one graph serves every depth (the name-keyed ``observe`` recompiled
the block once per attention, and the ninth was a hard error). It cannot run outside the
graph instead: ``torch.compiler.disable`` is a graph break, an error under
``fullgraph=True``.

Refused, with the reason, because clipping their rows would not do what QK-clip
promises:

* QK-norm (qwen3's ``q_norm``/``k_norm``): the norm undoes any scaling of ``W_q``/``W_k``,
  so the clip cannot bound the logits (and QK-norm already bounds them);
* MLA (deepseek_v3: ``wq_a``/``wq_b``/``wkv_a``...): its heads' rows are not one block of
  ``wq``/``wk``; dmuon does not map them;
* biased ``wq``/``wk`` (gpt_oss): scaling the weight rows leaves the bias, so the logit
  would not land on the threshold;
* varlen attention and context parallelism: the hook would see packed or partial
  sequences, so its maxima would not be the real logits' maxima.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from dmuon import AttentionHeads, DMuon, MaxLogitTracker

from ..logit_slots import logit_slot
from ..routing import unwrapped_name

INNER = "inner_attention"


class QKClipUnsupported(ValueError):
    """A model whose attention QK-clip cannot handle (see the module docstring)."""


def attentions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every attention of ``model``: the modules with an
    ``inner_attention`` child, in ``named_modules`` order (the same on every rank)."""
    # Named as in the plain model: a compiled or checkpointed block's attention too.
    return [(unwrapped_name(name), module) for name, module in model.named_modules()
            if isinstance(getattr(module, INNER, None), nn.Module)]


def require_attentions(model_parts: list[nn.Module]) -> None:
    """Refuse a model in which no part has an attention this module recognizes: QK-clip
    would otherwise be on in the config and silently do nothing."""
    if not any(attentions(part) for part in model_parts):
        names = sorted({type(part).__name__ for part in model_parts})
        raise QKClipUnsupported(f"QK-clip: no module of {names} has an {INNER!r} child; the hooks know only "
                                "TorchTitan's attention modules. Turn QK-clip off for this model.")


# What every refusal suggests (both TorchTitan lines spell the option qk_clip_threshold).
TURN_OFF = "or turn QK-clip off for this model (qk_clip_threshold 0 / None, and no max-logit tracking)"


def _check_supported(fqn: str, attention: nn.Module, context_parallel: bool) -> None:
    what = f"QK-clip: attention {fqn!r} ({type(attention).__module__}.{type(attention).__name__})"
    if getattr(attention, "q_norm", None) is not None or getattr(attention, "k_norm", None) is not None:
        raise QKClipUnsupported(f"{what} normalizes q and k (QK-norm): scaling W_q/W_k cannot change its logits, "
                                f"and QK-norm already bounds them. Build the model without qk_norm, {TURN_OFF}.")
    if not all(isinstance(getattr(attention, name, None), nn.Linear) for name in ("wq", "wk")):
        raise QKClipUnsupported(f"{what} has no wq/wk projections (MLA, as in deepseek_v3?): dmuon does not map "
                                f"its heads' rows. Use a model with wq/wk attention, {TURN_OFF}.")
    if attention.wq.bias is not None or attention.wk.bias is not None:
        raise QKClipUnsupported(f"{what}: wq/wk have a bias, which clipping the weight rows would not scale, so "
                                f"the logits would not be bounded. Use bias-free wq/wk, {TURN_OFF}.")
    if getattr(attention, "attn_type", "sdpa") == "varlen":
        raise QKClipUnsupported(f"{what} uses varlen attention (packed documents), whose masks the hook does "
                                f"not read. Use attn_type 'sdpa' or 'flex', {TURN_OFF}.")
    if context_parallel:
        raise QKClipUnsupported(f"{what}: under context parallelism each rank sees part of the sequence, so its "
                                f"logit maxima would be wrong. Set context_parallel_degree = 1, {TURN_OFF}.")


def _observer(tracker: MaxLogitTracker, slot: torch.Tensor, tp_rank: int):
    """The forward pre-hook of one attention's ``inner_attention``, folding into its ``slot``."""

    def observe(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        q, k = args[0], args[1]
        # Tensor parallelism splits heads evenly: this rank holds heads tp_rank * local ...
        local_heads = q.shape[1]
        block_mask = kwargs.get("block_mask")
        if block_mask is not None:  # FlexAttention: its mask says which keys each query sees
            mask = {"causal": False, "mask_mod": block_mask.mask_mod}
        else:  # SDPA: TorchTitan's wrapper is causal unless told otherwise
            mask = {"causal": kwargs.get("is_causal", True)}
        tracker.observe_into(slot, q, k, head_offset=tp_rank * local_heads, scale=kwargs.get("scale"), **mask)

    return observe


def install_max_logit_hooks(model: nn.Module, optimizer: DMuon, *, tp_rank: int = 0,
                            context_parallel: bool = False) -> list[Any]:
    """Register every attention of ``model`` (one model part: under pipeline parallelism
    only its own layers) with ``optimizer.clip_attention`` and hook its
    ``inner_attention`` to report logits; return the hooks' handles.

    ``tp_rank``: this rank's place on the tensor-parallel mesh (0 without TP), which puts
    its local heads among all heads. Whether heads get clipped is the optimizer's
    ``qk_clip_threshold`` (None: logits are only measured, for telemetry). Raises
    ``QKClipUnsupported`` before touching anything if one attention cannot be clipped.
    """
    found = attentions(model)  # may be none in one pipeline stage; the caller checks the whole model
    for fqn, attention in found:
        _check_supported(fqn, attention, context_parallel)
    handles = []
    for fqn, attention in found:
        heads = AttentionHeads(attention.n_heads, getattr(attention, "n_kv_heads", None) or attention.n_heads,
                               attention.head_dim)
        optimizer.clip_attention(fqn, attention.wq.weight, attention.wk.weight, heads)
        slot = logit_slot(optimizer, fqn, heads.n_heads, attention.wq.weight)
        handles.append(getattr(attention, INNER).register_forward_pre_hook(
            _observer(optimizer.max_logits, slot, tp_rank), with_kwargs=True))
    return handles
