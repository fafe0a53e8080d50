"""Turning DMuon's ``params`` argument into validated param groups.

Kept apart from the step so that the rules a user meets first (which parameter gets
which algorithm, which values are legal) read in one place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from dmuon.torch_compat import local_of
from dmuon.numerics.device_scalars import DEVICE_HYPERPARAMETERS, device_scalar
from dmuon.options.device_hyperparameters import SCHEDULER_VALUES as SCHEDULER_KEYS  # to every group made from one
from dmuon.options.implementation_flags import NO_PATH_KEYS, check_no_fused_muon, check_no_path_flags, own_flags
from dmuon.options.checks import check_muon_param
from dmuon.options.table import (ADAMW_ALIASES, ADAMW_KEYS, DEFAULTS, FLAG_KEYS, MUON_KEYS,
                                 SHARED_KEYS, check_group)

# By default, a parameter with ndim >= 2 gets Muon unless its name marks it as an
# embedding or an output head: those are lookup tables / classifiers, not linear maps
# between hidden states, and Muon's orthogonal update does not suit them. The head is
# matched only as the last module (``output.weight``, ``lm_head.weight``), so hidden
# layers such as BERT's ``attention.output.dense.weight`` keep Muon.
DEFAULT_ADAMW_NAME_PATTERN = r"(^|\.)(embed\w*|tok_embeddings|wte|wpe)\.|(^|\.)(output|lm_head|head)\.(weight|bias)$"

# The options a user's group may set (besides ``params``, ``param_names`` and
# ``use_muon``), by what it becomes: a Muon group (``use_muon=True``), an AdamW group
# (``use_muon=False``), or both (no ``use_muon``: split by the default routing).
GROUP_OPTIONS = {
    True: frozenset(MUON_KEYS + SCHEDULER_KEYS + FLAG_KEYS),
    False: frozenset(ADAMW_KEYS + tuple(ADAMW_ALIASES) + SCHEDULER_KEYS + FLAG_KEYS),
    None: frozenset(MUON_KEYS + ADAMW_KEYS + tuple(ADAMW_ALIASES) + SCHEDULER_KEYS + FLAG_KEYS),
}
GROUP_KIND = {True: "a Muon group", False: "an AdamW group", None: "a group without use_muon (split)"}


def default_use_muon(
    name: str | None, param: torch.Tensor, adamw_name_pattern: str | re.Pattern[str] = DEFAULT_ADAMW_NAME_PATTERN
) -> bool:
    """The default routing: Muon for real ndim >= 2 tensors, unless ``name`` matches
    ``adamw_name_pattern`` (``re.search``; a compiled pattern is taken too). The one
    statement of the rule: TorchTitan's ``goes_to_adamw`` calls it."""
    if param.ndim < 2 or param.is_complex():
        return False
    return name is None or re.search(adamw_name_pattern, name) is None


def build_param_groups(
    param_group: Any,
    index: int,
    existing: list[dict[str, Any]],
    muon_defaults: dict[str, Any],
    adamw_defaults: dict[str, Any],
    implementation: Mapping[str, Any] | None = None,
) -> list[tuple[list[str], dict[str, Any]]]:
    """DMuon's groups for the user's ``index``-th group, each with its parameters'
    display names; ``existing`` (the groups made so far) is only read; ``implementation``:
    the optimizer's ``foreach`` and ``fused``, for a group that sets neither.

    A group without ``use_muon`` is split by :func:`default_use_muon` into a Muon and
    an AdamW group (each keeps the options it knows). A group of ``(name, tensor)``
    pairs keeps the names, in order, under ``param_names``, as torch.optim does.
    """
    if not isinstance(param_group, dict):
        raise TypeError(f"DMuon: a param group must be a dict, got {type(param_group).__name__}")
    if "params" not in param_group:
        raise ValueError("DMuon: a param group needs a 'params' entry")
    where = f"DMuon param group {index}"
    named, has_names = _named_params(param_group, index, where)
    _check_membership(named, has_names, index, existing, where)
    use_muon = param_group.get("use_muon")
    if use_muon is not None and not isinstance(use_muon, bool):
        raise TypeError(f"{where}: use_muon must be a bool, got {use_muon!r}")
    options = {k: v for k, v in param_group.items() if k not in ("params", "param_names", "use_muon")}
    unknown = set(options) - GROUP_OPTIONS[use_muon]
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {sorted(unknown)} for {GROUP_KIND[use_muon]}; "
                         f"known: {sorted(GROUP_OPTIONS[use_muon])}")
    check_no_fused_muon(options, use_muon, where)
    check_no_path_flags({key: options[key] for key in NO_PATH_KEYS if key in options}, where)
    groups = []
    for kind in (True, False) if use_muon is None else (use_muon,):
        members = [(n, p) for n, p in named if use_muon is not None or default_use_muon(n, p) == kind]
        if members:
            defaults = muon_defaults if kind else adamw_defaults
            group = make_group(members, kind, has_names, options, defaults, where, implementation,
                               split=use_muon is None)
            groups.append(([n for n, _ in members], group))
    return groups


def _named_params(param_group: dict[str, Any], index: int, where: str) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """``(name, tensor)`` of each parameter (a bare tensor is named by its position),
    and whether the user named them: all of them or none, as torch.optim requires."""
    raw = param_group["params"]
    if isinstance(raw, torch.Tensor):
        raw = [raw]
    elif isinstance(raw, (set, frozenset)):
        raise TypeError("DMuon: params must be an ordered collection (list), not a set")
    raw = list(raw)
    if not raw:
        raise ValueError(f"{where} is empty")
    pairs = [isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in raw]
    if "param_names" in param_group:
        names = list(param_group["param_names"])
        if any(pairs) or len(names) != len(raw) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}: param_names must be one str per parameter, with bare tensors as params; "
                             "or pass (name, tensor) pairs without param_names")
        raw, pairs = list(zip(names, raw)), [True] * len(raw)  # as if given as pairs
    if any(pairs) and not all(pairs):
        raise ValueError(  # holds torch's words, for code that matches on them
            f"{where}: all optimizer params should be with/without names. Some param names are missing: "
            f"{sum(pairs)} of {len(raw)} are (name, tensor) pairs; pass every parameter with its name "
            "(model.named_parameters()) or none"
        )
    named = raw if all(pairs) else [(f"param_groups[{index}][{i}]", item) for i, item in enumerate(raw)]
    for name, param in named:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"DMuon: parameter {name!r} is a {type(param).__name__}, expected a torch.Tensor")
        if not param.is_leaf:
            raise ValueError(f"DMuon: parameter {name!r} is not a leaf tensor; pass model parameters")
    return named, all(pairs)


def _check_membership(
    named: list[tuple[str, torch.Tensor]], has_names: bool, index: int, existing: list[dict[str, Any]], where: str
) -> None:
    """Each parameter in one group only, once; names in every group or in none."""
    in_other_groups = {id(p) for group in existing for p in group["params"]}
    seen: set[int] = set()
    for name, param in named:
        if id(param) in in_other_groups:
            raise ValueError(f"DMuon: parameter {name!r} appears in more than one param group")
        if id(param) in seen:
            raise ValueError(f"DMuon: parameter {name!r} appears twice in param group {index}")
        seen.add(id(param))
    if existing and ("param_names" in existing[0]) != has_names:
        this, others = ("with names", "have none") if has_names else ("without names", "have names")
        raise ValueError(  # holds torch's words, for code that matches on them
            f"{where}: all optimizer param groups should be with/without names. cannot add param group {this} to "
            f"the optimizer: the groups before it {others}; pass (name, tensor) pairs in every group or in none"
        )


def make_group(
    members: list[tuple[str, torch.Tensor]],
    use_muon: bool,
    has_names: bool,
    options: dict[str, Any],
    defaults: dict[str, Any],
    where: str,
    implementation: Mapping[str, Any] | None = None,
    split: bool = False,
) -> dict[str, Any]:
    """One checked Muon or AdamW group: the group's options over the optimizer's defaults
    (:func:`part_values`), and its own ``foreach`` / ``fused`` where it sets them
    (``implementation``: the optimizer's, which a group without them steps with)."""
    values = part_values(options, use_muon, defaults, split)
    check_group(values, use_muon, where)
    if use_muon:
        for name, param in members:
            check_muon_param(param, name, values["split_rows"])
    group: dict[str, Any] = {"params": [p for _, p in members]}
    if has_names:
        group["param_names"] = [n for n, _ in members]
    group.update(use_muon=use_muon, **values)
    group.update(own_flags(members, use_muon, options, values["lr"], implementation or {}, where))
    group["capturable"] = group.get("capturable", (implementation or {}).get("capturable", False))
    if group["capturable"]:  # made once here, updated in place by LR schedulers
        device = local_of(members[0][1]).device
        group.update({key: device_scalar(group[key], device) for key in DEVICE_HYPERPARAMETERS})
    if "initial_lr" in options:
        group["initial_lr"] = options["initial_lr"]
    return group


def part_values(options: Mapping[str, Any], use_muon: bool, defaults: Mapping[str, Any], split: bool = False
                ) -> dict[str, Any]:
    """A Muon (``use_muon``) or AdamW group's option values: the user's group ``options`` over
    the optimizer's ``defaults``; for the AdamW part ``adamw_<x>`` over ``<x>`` (None: unset
    where the option's default is None, as DMuon's keyword is). The AdamW part of a ``split``
    group (no ``use_muon``) takes no Muon option of its key: a split group's ``eps`` is
    Newton-Schulz's, as ``DMuon(eps=...)`` is (AdamW's: ``adamw_eps``)."""
    if use_muon:
        return {key: options.get(key, defaults[key]) for key in MUON_KEYS}
    if split:
        options = {key: value for key, value in options.items() if key not in MUON_KEYS or key in SHARED_KEYS}
    values = {key: options.get(key, defaults[key]) for key in ADAMW_KEYS}
    values.update({key: options[alias] for alias, key in ADAMW_ALIASES.items()
                   if alias in options and (options[alias] is not None or DEFAULTS[alias] is not None)})
    return values


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Muon and AdamW group defaults that DMuon's keyword arguments ``options``
    make: the Muon keys as given, and the AdamW part with ``adamw_<x>`` over ``<x>``
    (None: unset). An option left out takes its default (``dmuon.options.table``)."""
    options = {**DEFAULTS, **options}
    muon = {key: options[key] for key in MUON_KEYS}
    adamw = {key: options[key] for key in SHARED_KEYS}
    adamw.update({key: options[alias] for alias, key in ADAMW_ALIASES.items()
                  if options[alias] is not None or key not in adamw})  # adamw_<x> over <x>
    return muon, adamw


def muon_groups(param_groups: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Each Muon parameter's group, in order."""
    return {p: g for g in param_groups if g["use_muon"] for p in g["params"]}
