"""Which optimizer each parameter of a TorchTitan model gets: Muon (whole or per
head) or AdamW. Written once for both TorchTitan lines; imports nothing from TorchTitan.

* AdamW: names matching the AdamW regex (embeddings, output head, norms by default)
  and anything Muon cannot update (0-D/1-D, complex): ``dmuon.default_use_muon``.
* Muon per head: with ``split_attention_heads``, the ``wq``/``wk``/``wv`` weights of
  every module that has a ``head_dim``.
* Muon: every other matrix.

Every model part (pipeline stage) must end up with the same group kinds in the same
order: TorchTitan saves the first stage's LR-scheduler state and loads it into every
stage's scheduler, and an empty group breaks checkpoint loading (``group_layout``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch.nn as nn
from dmuon import DEFAULT_ADAMW_NAME_PATTERN, default_use_muon

# Module wrappers TorchTitan may add (activation checkpointing, torch.compile, FSDP1):
# DCP drops them from the fully qualified names it saves, and the extension's own names
# (routing checks, QK-clip's attentions) leave them out alike.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def unwrapped_name(fqn: str) -> str:
    """``fqn`` without the wrappers' segments (``layers.0._orig_mod.attention`` ->
    ``layers.0.attention``): the name the plain model, and a checkpoint, give it."""
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_SEGMENTS)

# AdamW by name: dmuon's own pattern (embeddings, output head) plus every norm.
DEFAULT_ADAMW_PARAM_REGEX = DEFAULT_ADAMW_NAME_PATTERN + "|norm"

MUON_HEADS, MUON, ADAMW = "muon_heads", "muon", "adamw"
# Attention projections whose rows are heads (split_attention_heads).
HEAD_PROJECTIONS = ("wq", "wk", "wv")
# TorchTitan 0.3.x's fused projection: [n_kv_heads, q-heads-per-kv + 2, head_dim] rows.
FUSED_QKV = "wqkv"


@dataclass
class RoutedParameters:
    """The trainable parameters of one model part, split by optimizer."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    muon_heads: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """Attention projections orthogonalized per head (``split_attention_heads``)."""
    head_dims: set[int] = field(default_factory=set)
    """Head sizes of the ``muon_heads`` parameters."""

    def of_kind(self, kind: str) -> list[tuple[str, nn.Parameter]]:
        return {MUON: self.muon, ADAMW: self.adamw, MUON_HEADS: self.muon_heads}[kind]


def goes_to_adamw(name: str, param: nn.Parameter, adamw_regex: re.Pattern[str]) -> bool:
    """AdamW for names matching the regex and for anything Muon cannot update (not a
    real matrix): dmuon's default routing, with ``[optimizer] adamw_param_regex``."""
    return not default_use_muon(name, param, adamw_regex)


def attention_head_dims(model: nn.Module) -> dict[nn.Parameter, int]:
    """Weights whose blocks of ``head_dim`` rows are attention heads -> ``head_dim``:
    ``wq``/``wk``/``wv`` of every module with a ``head_dim`` (TorchTitan 0.2.x), and
    the fused ``wqkv`` (TorchTitan 0.3.x), whose rows are whole heads of q, k and v."""
    heads: dict[nn.Parameter, int] = {}
    for module in model.modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int):
            continue
        projections = HEAD_PROJECTIONS if all(hasattr(module, n) for n in HEAD_PROJECTIONS) else ()
        for projection in (*projections, FUSED_QKV):
            weight = getattr(getattr(module, projection, None), "weight", None)
            if isinstance(weight, nn.Parameter):
                heads[weight] = head_dim
    return heads


def route_parameters(model: nn.Module, adamw_param_regex: str, split_attention_heads: bool = False) -> RoutedParameters:
    """Split ``model``'s trainable parameters into Muon (per head, or whole) and AdamW
    lists (model order)."""
    pattern = re.compile(adamw_param_regex)
    heads = attention_head_dims(model) if split_attention_heads else {}
    routed = RoutedParameters()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if goes_to_adamw(name, param, pattern):
            routed.adamw.append((name, param))
        elif param in heads:
            routed.muon_heads.append((name, param))
            routed.head_dims.add(heads[param])
        else:
            routed.muon.append((name, param))
    return routed


def group_layout(routed_parts: list[RoutedParameters]) -> list[str]:
    """The group kinds every part gets, in order (see the module docstring)."""
    layout = [k for k in (MUON_HEADS, MUON, ADAMW) if any(r.of_kind(k) for r in routed_parts)]
    if not layout:
        raise ValueError("DMuon: the model has no trainable parameters.")
    for index, routed in enumerate(routed_parts):
        for kind in layout:
            if not routed.of_kind(kind):
                raise ValueError(
                    f"DMuon: model part {index} (pipeline stage) has no parameter for the "
                    f"{kind} group while other parts do. Every part needs the same param "
                    "groups (TorchTitan shares one LR-scheduler state across parts). "
                    "Change the pipeline split ([parallelism] pipeline_parallel_*) or "
                    "[optimizer] adamw_param_regex."
                )
    return layout


def embeddings_and_heads(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The lookup tables and output heads of ``model``: the weights of its ``nn.Embedding``
    modules and the parameters named like an embedding or an output head (dmuon's
    ``DEFAULT_ADAMW_NAME_PATTERN``), whatever ``adamw_param_regex`` says."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [(name, p) for name, p in model.named_parameters()
            if id(p) in tables or re.search(DEFAULT_ADAMW_NAME_PATTERN, name)]


def check_some_muon(models: Iterable[nn.Module], in_muon: Callable[[nn.Parameter], bool], regex: str) -> None:
    """Refuse a routing that leaves Muon nothing although the model has matrices the default
    routing gives it (an ``adamw_param_regex`` such as ``""`` or ``".*"``): the job would
    train with AdamW alone while reporting DMuon. A pipeline stage that has no such matrix
    (only norms and the output head) is left alone."""
    models = list(models)
    named = [(name, p) for model in models for name, p in model.named_parameters() if p.requires_grad]
    if any(in_muon(p) for _, p in named):
        return
    taken = [name for name, p in named if not goes_to_adamw(name, p, re.compile(DEFAULT_ADAMW_PARAM_REGEX))]
    if taken:
        raise ValueError(
            f"DMuon: adamw_param_regex {regex!r} routes all {len(named)} trainable tensors to AdamW and none "
            f"to Muon (among them the matrices {taken[:3]}{' ...' if len(taken) > 3 else ''}), so the job would "
            "be AdamW under DMuon's name. Give a regex that matches only the embeddings, output head and "
            f"norms (default {DEFAULT_ADAMW_PARAM_REGEX!r}), or use the AdamW optimizer."
        )


def muon_embeddings_warning(models: Iterable[nn.Module], in_muon: Callable[[nn.Parameter], bool],
                            regex: str) -> str | None:
    """The warning for embeddings or output heads routed to Muon (say by ``"(?!)"``), naming
    them; ``None`` when there are none. A warning, not an error: orthogonalizing them is
    an experiment some users run on purpose."""
    names = [name for model in models for name, p in embeddings_and_heads(model) if in_muon(p)]
    if not names:
        return None
    return (f"DMuon: adamw_param_regex {regex!r} routes the embedding / output head {names} to Muon; Muon's "
            "orthogonal update is meant for hidden matrices, and these usually train with AdamW. If that is "
            f"not what you want, include them in the regex (default {DEFAULT_ADAMW_PARAM_REGEX!r}).")
