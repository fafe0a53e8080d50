"""How one of TorchTitan 0.3's DMuon group dicts becomes DMuon's groups.

Routing (a choice, explained): one ``".*"`` DMuon group by default, which the
container splits per model part with the shared rule (``torchtitan_ext.routing``):
matrices -> Muon, embeddings / output head / norms / anything not a real matrix ->
AdamW (DMuon's own AdamW part). Separate AdamW ``ParamGroupConfig`` patterns would
need the user to restate that rule as regexes, cannot say "1-D or complex", and
TorchTitan raises for a pattern that matches no parameter -- which a pipeline stage
without the embedding or the head would hit. Both Muon and AdamW of a part live in
one DMuon, which also gives one telemetry record per part.

The Muon parameters of the groups made here are then checked to be whole matrices or
DTensors (``check_whole_or_dtensor``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor

from dmuon.options import GROUP_OPTIONS, IMPLEMENTATION_KEYS

from ..routing import ADAMW, DEFAULT_ADAMW_PARAM_REGEX, MUON, MUON_HEADS, attention_head_dims, route_parameters


def kinds_of(model: nn.Module, regex: str, split_heads: bool) -> dict[int, tuple[str, int | None]]:
    """id(parameter) -> (MUON_HEADS | MUON | ADAMW, split_rows) by the shared rule."""
    routed = route_parameters(model, regex)
    heads = attention_head_dims(model) if split_heads else {}
    kinds: dict[int, tuple[str, int | None]] = {id(p): (ADAMW, None) for _, p in routed.adamw}
    for _, param in routed.muon:
        kinds[id(param)] = (MUON_HEADS, heads[param]) if param in heads else (MUON, None)
    return kinds


def split_dmuon_group(model: nn.Module, group: dict[str, Any], own: Collection[str] = ()) -> list[dict[str, Any]]:
    """One of TorchTitan's group dicts for DMuon -> DMuon's groups, each with ``use_muon``.

    Drops the ``fused``/``foreach`` keys TorchTitan adds from ``implementation`` (DMuon
    gets that as its whole-optimizer flags), but not those among ``own``, the keys of the
    group's own ``optimizer_kwargs``. A group that sets ``use_muon`` is kept whole;
    otherwise it is split into per-head Muon (one group per head size), Muon and AdamW
    groups, each with the options that apply to it (``fused`` to the AdamW group only).
    """
    dropped = {"params", "param_names", *(set(IMPLEMENTATION_KEYS) - set(own))}
    options = {k: v for k, v in group.items() if k not in dropped}
    if "use_muon" in options:
        return [{"params": group["params"], "param_names": group["param_names"], **options}]
    regex = options.pop("adamw_param_regex", DEFAULT_ADAMW_PARAM_REGEX)
    kinds = kinds_of(model, regex, options.pop("split_attention_heads", False))
    members: dict[tuple[str, int | None], list[tuple[str, nn.Parameter]]] = {}
    for name, param in zip(group["param_names"], group["params"]):
        members.setdefault(kinds[id(param)], []).append((name, param))
    order = sorted(members, key=lambda kind: ((MUON_HEADS, MUON, ADAMW).index(kind[0]), kind[1] or 0))
    return [_group_of(kind, members[kind], options) for kind in order]


def _group_of(kind: tuple[str, int | None], members: list[tuple[str, nn.Parameter]],
              options: dict[str, Any]) -> dict[str, Any]:
    use_muon = kind[0] != ADAMW
    group = {"params": [p for _, p in members], "param_names": [n for n, _ in members], "use_muon": use_muon}
    group.update({k: v for k, v in options.items() if k in GROUP_OPTIONS[use_muon] and not (use_muon and k == "fused")})
    if kind[0] == MUON_HEADS:
        group["split_rows"] = kind[1]
    return group


def check_whole_or_dtensor(names: list[str], params: list[nn.Parameter]) -> None:
    """Refuse a plain-tensor Muon parameter that ``spmd_types`` marks as differing across
    the ranks of a mesh axis (``V``, e.g. a TP shard, or ``P``).

    Under ``parallelism.spmd_backend = "spmd_types"`` TorchTitan shards TP/EP weights
    as plain local tensors carrying an ``spmd_types`` annotation; FSDP's
    ``fully_shard`` (which TorchTitan's parallelize functions always apply) turns
    them into DTensors, which DMuon understands. A path that skipped that step would
    hand DMuon a slice it takes for a whole matrix: wrong math, no error. So refuse.
    """
    try:
        import spmd_types as spmd
    except ImportError:  # no annotations can exist
        return
    for name, param in zip(names, params):
        if isinstance(param, DTensor):
            continue
        for axis, axis_type in spmd.get_local_type(param).items():
            if axis.size() > 1 and axis_type not in (spmd.R, spmd.I):
                raise ValueError(
                    f"DMuon: parameter {name!r} is a plain tensor that spmd_types "
                    f"marks {axis_type} on mesh axis {axis} ({axis.size()} ranks): each rank holds a "
                    "different part of it, and Muon must orthogonalize whole matrices. DMuon needs it "
                    "as a DTensor: keep FSDP applied (TorchTitan's parallelize functions turn the "
                    "annotations into DTensors), or set parallelism.spmd_backend = \"full_dtensor\"."
                )
