"""QK-clip for TorchTitan 0.3 models: register each attention with DMuon and report its
logits from a forward pre-hook.

DMuon clips a head's rows of ``W_q``/``W_k`` after a step in which the head's largest
pre-softmax logit exceeded the Muon group's ``qk_clip_threshold``; it needs, per
attention, (1) the weights and head layout (``DMuon.clip_attention``) and (2) the
step's ``q`` and ``k`` as the softmax sees them (``DMuon.max_logits.observe``).

Where they come from in 0.3: ``GQAttention.forward`` projects with its ``qkv_linear``
(``QKVLinear``: ``wq``/``wk``/``wv``; ``FusedQKVLinear``: one ``wqkv``), applies RoPE and
calls ``inner_attention(q, k, v, attention_masks=..., scale=..., enable_gqa=...)`` with
``[batch, seq, heads, head_dim]`` tensors. A pre-hook on ``inner_attention`` therefore
sees exactly the softmax's ``q`` and ``k``, its scale (``None``: ``head_dim ** -0.5``) and
its masks, whatever the inner attention (flex, varlen, ``CpuBlockCausalAttention``).

Masks: TorchTitan packs documents into each sequence. ``VarlenMetadata`` (varlen and
``CpuBlockCausalAttention``) carries the document starts; a flex ``BlockMask`` carries
its ``mask_mod``. Either becomes the ``mask_mod`` of ``observe``, so a logit between two
documents, which the softmax never sees, does not count. No mask: causal only.

Under ``torch.compile`` (TorchTitan compiles each block with ``fullgraph=True``) the
hook is traced into the block's graph: it folds into the attention's slot
(``torchtitan_ext/logit_slots.py``), and the masks are rebuilt in each block instead of
cached, so every block traces the same ops and one graph serves them all.

Refused, naming the module: attentions with a QK-norm (the norm undoes any scaling of
``W_q``/``W_k``, so clipping cannot bound its logits), MLA (DeepSeek-V3, Kimi: dmuon
does not map its rows), any other attention class (its forward is not the one read
here), and q/k projections with a bias (scaling weight rows leaves the bias).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.hooks import RemovableHandle
from torchtitan.models.common.attention import (
    BaseAttention,
    FusedQKVLinear,
    GQAttention,
    QKVLinear,
    VarlenMetadata,
)

from dmuon import FUSED_GROUPED, SEPARATE, AttentionHeads, DMuon, MaskMod

from ..logit_slots import logit_slot
from .cpu_attention import document_ids_from_boundaries

# The names TorchTitan gives the tensor- and context-parallel mesh axes.
TP_MESH_DIM = "tp"
CP_MESH_DIM = "cp"


def qk_clip_enabled(optimizer: DMuon) -> bool:
    """True when some Muon group of ``optimizer`` has a ``qk_clip_threshold``."""
    return any(g["use_muon"] and g.get("qk_clip_threshold") is not None for g in optimizer.param_groups)


def install_qk_clip(model: nn.Module, optimizer: DMuon) -> list[RemovableHandle]:
    """Register every attention of ``model`` (one model part) with ``optimizer`` and hook
    its ``inner_attention``; return the hooks' handles.

    Every rank walks the same modules in the same order, as ``clip_attention`` needs.
    Under pipeline parallelism ``model`` is one stage: its DMuon gets only its layers.
    """
    handles = []
    documents = DocumentMasks()  # shared: every layer of a forward gets the same masks
    for name, module in model.named_modules():
        if not isinstance(module, BaseAttention):
            continue
        q_weight, k_weight, heads = _clip_weights(name, module)
        _refuse_context_parallel(name, q_weight)
        optimizer.clip_attention(name, q_weight, k_weight, heads)
        slot = logit_slot(optimizer, name, heads.n_heads, q_weight)
        hook = _report_logits(name, module, optimizer, slot, documents, tp_rank=_tp_rank(q_weight))
        handles.append(module.inner_attention.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def _clip_weights(name: str, attention: nn.Module) -> tuple[torch.Tensor, torch.Tensor, AttentionHeads]:
    """``(q_weight, k_weight, heads)`` of one attention, or ``ValueError`` saying why not."""
    off = "or leave qk_clip_threshold unset (None) for this model"
    if hasattr(attention, "kv_lora_rank"):  # DeepSeek-V3's Attention, which Kimi reuses
        raise ValueError(f"QK-clip: {name} ({type(attention).__name__}) is multi-head latent attention (MLA); "
                         f"dmuon does not map MLA's query/key rows, so it cannot clip it: {off}")
    if not isinstance(attention, GQAttention) or type(attention).forward is not GQAttention.forward:
        raise ValueError(f"QK-clip: {name} is a {type(attention).__qualname__}, not TorchTitan's GQAttention; "
                         f"the logit hook reads GQAttention's forward only: {off}")
    if attention.q_norm is not None or attention.k_norm is not None:
        raise ValueError(f"QK-clip: {name} has a QK-norm (q_norm/k_norm), which normalizes q and k after W_q/W_k: "
                         f"scaling their rows cannot bound its logits (the norm already bounds them). Turn QK-clip "
                         f"off for this model ({off.removeprefix('or ')})")
    qkv = attention.qkv_linear
    if isinstance(qkv, FusedQKVLinear):
        projections, layout = {"wqkv": qkv.wqkv}, FUSED_GROUPED
    elif isinstance(qkv, QKVLinear):
        projections, layout = {"wq": qkv.wq, "wk": qkv.wk}, SEPARATE
    else:
        raise ValueError(f"QK-clip: {name}.qkv_linear is a {type(qkv).__qualname__}; only QKVLinear (wq/wk) and "
                         f"FusedQKVLinear (wqkv) have known row layouts: {off}")
    for part, linear in projections.items():
        if getattr(linear, "bias", None) is not None:
            raise ValueError(f"QK-clip: {name}.qkv_linear.{part} has a bias; clipping scales weight rows only, "
                             f"which would leave the bias's share of the logits unbounded: {off}")
    weights = [linear.weight for linear in projections.values()]
    heads = AttentionHeads(attention.n_heads, attention.n_kv_heads, attention.head_dim, row_layout=layout)
    return weights[0], weights[-1], heads


def _refuse_context_parallel(name: str, weight: torch.Tensor) -> None:
    """Under context parallelism a rank's q and k are chunks of the sequence: the hook
    would miss the logits between chunks and apply the causal mask to local positions.
    Seen where the weights' mesh names a ``cp`` axis (the ``spmd_types`` and
    ``full_dtensor`` backends); the legacy backend flattens it into ``fsdp``, where it
    cannot be told apart (docs/torchtitan.md says so)."""
    if not isinstance(weight, DTensor):
        return
    names = weight.device_mesh.mesh_dim_names or ()
    if CP_MESH_DIM in names and weight.device_mesh.size(names.index(CP_MESH_DIM)) > 1:
        raise ValueError(f"QK-clip: {name} runs under context parallelism, where each rank sees a chunk of the "
                         "sequence and its logit maxima would be wrong; set context_parallel_degree = 1 or leave "
                         "qk_clip_threshold unset (None)")


def _tp_rank(weight: torch.Tensor) -> int | None:
    """This rank's position on the weight's ``tp`` mesh axis (heads are split there), or
    ``None`` when the weight is not tensor-parallel."""
    if not isinstance(weight, DTensor):
        return None
    names = weight.device_mesh.mesh_dim_names or ()
    return weight.device_mesh.get_local_rank(TP_MESH_DIM) if TP_MESH_DIM in names else None


def _report_logits(name: str, attention: GQAttention, optimizer: DMuon, slot: torch.Tensor,
                   documents: DocumentMasks, tp_rank: int | None) -> Callable:
    """The pre-hook of ``attention.inner_attention``: fold its ``q``/``k``'s logits into
    the attention's ``slot`` of DMuon's tracker.

    Traced into the block's graph under ``torch.compile`` (TorchTitan compiles each block
    with ``fullgraph=True``, where ``torch.compiler.disable`` is a graph break and so an
    error): it reads no per-attention name, and every block traces the same ops
    (``torchtitan_ext/logit_slots.py``)."""
    n_heads = attention.n_heads
    tracker = optimizer.max_logits

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():  # evaluation: not the training step's logits
            return
        q, k = (t.to_local() if isinstance(t, DTensor) else t for t in args[:2])
        batch, seq_len, local_heads = q.shape[:3]
        if local_heads < n_heads and tp_rank is None:
            raise ValueError(f"QK-clip: {name} sees {local_heads} of {n_heads} heads but its weights have no "
                             f"{TP_MESH_DIM!r} mesh axis to place them; dmuon cannot tell which heads these are")
        tracker.observe_into(
            slot, q.transpose(1, 2), k.transpose(1, 2), head_offset=(tp_rank or 0) * local_heads,
            scale=kwargs.get("scale"), causal=True,
            mask_mod=documents.mask_mod(kwargs.get("attention_masks"), batch, seq_len))

    return hook


class DocumentMasks:
    """The document ``mask_mod`` of a forward's ``attention_masks``, made once per forward
    in eager (every layer gets the same masks object; reading varlen boundaries syncs the
    host), and in every block under ``torch.compile`` (traced, without a host read)."""

    def __init__(self) -> None:
        self._last: tuple[object, MaskMod | None] | None = None

    def mask_mod(self, masks: object, batch: int, seq_len: int) -> MaskMod | None:
        if masks is None:
            return None  # causal only
        compiling = torch.compiler.is_compiling()  # traced: no cache (a guard on its identity would recompile)
        if not compiling and self._last is not None and self._last[0] is masks:
            return self._last[1]
        if isinstance(masks, VarlenMetadata):
            doc = document_ids_from_boundaries(masks.cu_seq_q, batch, seq_len)

            def same_document(b, h, q_idx, kv_idx):
                return doc[b, q_idx] == doc[b, kv_idx]

            mask_mod = same_document
        elif isinstance(masks, BlockMask):
            mask_mod = masks.mask_mod  # TorchTitan's causal + document mask, tensor-callable
        else:
            raise TypeError(f"QK-clip: attention_masks of type {type(masks).__name__} carry no document "
                            "boundaries dmuon can read (it reads VarlenMetadata and flex BlockMask)")
        if not compiling:
            self._last = (masks, mask_mod)
        return mask_mod
