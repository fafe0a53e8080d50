"""Turning DMuon's ``params`` argument into validated param groups.

Kept apart from the step so that the rules a user meets first (which parameter gets
which algorithm, which values are legal) read in one place.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from dmuon.numerics.newton_schulz import (
    DEFAULT_GRAM_RESTARTS,
    DEFAULT_NS_ALGORITHM,
    MAX_NS_STEPS,
    NS_ALGORITHMS,
    NS_COEFFICIENT_SETS,
    NS_DTYPE_CHOICES,
    NS_DTYPES,
    ns_dtype_name,
)
from dmuon.numerics.update_rules import ADJUST_LR_CHOICES, DEFAULT_NORMUON_BETA2
from dmuon.plan.paths import COMM_CHOICES

# By default, a parameter with ndim >= 2 gets Muon unless its name marks it as an
# embedding or an output head: those are lookup tables / classifiers, not linear maps
# between hidden states, and Muon's orthogonal update does not suit them. The head is
# matched only as the last module (``output.weight``, ``lm_head.weight``), so hidden
# layers such as BERT's ``attention.output.dense.weight`` keep Muon.
DEFAULT_ADAMW_NAME_PATTERN = r"(^|\.)(embed\w*|tok_embeddings|wte|wpe)\.|(^|\.)(output|lm_head|head)\.(weight|bias)$"

MUON_KEYS = (
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "ns_steps",
    "ns_coefficients",
    "ns_algorithm",
    "ns_gram_restarts",
    "eps",
    "adjust_lr",
    "matched_adamw_rms",
    "split_rows",
    "normuon",
    "normuon_beta2",
    "cautious_weight_decay",
    "qk_clip_threshold",
)
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "cautious_weight_decay")
# The update-rule variants (issue 16), each off by default so that a group without them
# steps bit for bit as before: NorMuon's neuron-wise normalization (Muon groups) and
# cautious weight decay (Muon and AdamW groups), and QK-clip's threshold (Muon groups
# holding attention weights; None: off), and Gram Newton-Schulz (issue 23: the standard
# iteration unless asked). A front end that has no field for one of them gets this
# default (``split_options``).
VARIANT_DEFAULTS = {"normuon": False, "normuon_beta2": DEFAULT_NORMUON_BETA2, "cautious_weight_decay": False,
                    "qk_clip_threshold": None, "ns_algorithm": DEFAULT_NS_ALGORITHM,
                    "ns_gram_restarts": DEFAULT_GRAM_RESTARTS}
# The constructor's AdamW keywords, accepted as group keys too: each sets the AdamW
# value of its plain key and, as ``adamw_lr`` over ``lr`` in the constructor, wins over
# it. None (the constructor's default of ``adamw_lr``) means unset.
ADAMW_ALIASES = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps", "adamw_weight_decay": "weight_decay"}
# The LR schedulers' key: it goes to every group made from the user's group.
SCHEDULER_KEYS = ("initial_lr",)
# The options a user's group may set (besides ``params``, ``param_names`` and
# ``use_muon``), by what it becomes: a Muon group (``use_muon=True``), an AdamW group
# (``use_muon=False``), or both (no ``use_muon``: split by the default routing).
GROUP_OPTIONS = {
    True: frozenset(MUON_KEYS + SCHEDULER_KEYS),
    False: frozenset(ADAMW_KEYS + tuple(ADAMW_ALIASES) + SCHEDULER_KEYS),
    None: frozenset(MUON_KEYS + ADAMW_KEYS + tuple(ADAMW_ALIASES) + SCHEDULER_KEYS),
}
GROUP_KIND = {True: "a Muon group", False: "an AdamW group", None: "a group without use_muon (split)"}

# DMuon's defaults that have no home in a lower module, written once for every front
# end (DMuon's signature, TorchTitan's ``[optimizer]`` fields) so they cannot drift.
DEFAULT_MOMENTUM = 0.95
DEFAULT_NESTEROV = True
DEFAULT_ADJUST_LR = "original"
DEFAULT_SPLIT_REPLICAS = None  # let the cost model decide


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
) -> list[tuple[list[str], dict[str, Any]]]:
    """DMuon's groups for the user's ``index``-th group, each with its parameters'
    display names; ``existing`` (the groups made so far) is only read.

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
    groups = []
    for kind in (True, False) if use_muon is None else (use_muon,):
        members = [(n, p) for n, p in named if use_muon is not None or default_use_muon(n, p) == kind]
        if members:
            defaults = muon_defaults if kind else adamw_defaults
            groups.append(([n for n, _ in members], make_group(members, kind, has_names, options, defaults, where)))
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
        raise ValueError(
            f"{where}: all parameters should be with or without names, but {sum(pairs)} of {len(raw)} are "
            "(name, tensor) pairs; pass every parameter with its name (model.named_parameters()) or none"
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
        this, others = ("has", "have none") if has_names else ("has none", "have")
        raise ValueError(
            f"{where}: all param groups should be with or without names, but this one {this} and the groups "
            f"before it {others}; pass (name, tensor) pairs in every group or in none"
        )


def make_group(
    members: list[tuple[str, torch.Tensor]],
    use_muon: bool,
    has_names: bool,
    options: dict[str, Any],
    defaults: dict[str, Any],
    where: str,
) -> dict[str, Any]:
    """One checked Muon or AdamW group: the group's options over the optimizer's defaults."""
    if use_muon:
        values = {key: options.get(key, defaults[key]) for key in MUON_KEYS}
        check_muon_hyperparameters(values, where)
        for name, param in members:
            check_muon_param(param, name, values["split_rows"])
    else:
        values = {key: options.get(key, defaults[key]) for key in ADAMW_KEYS}
        values.update({key: options[alias] for alias, key in ADAMW_ALIASES.items() if options.get(alias) is not None})
        check_adamw_hyperparameters(values, where)
    group: dict[str, Any] = {"params": [p for _, p in members]}
    if has_names:
        group["param_names"] = [n for n, _ in members]
    group.update(use_muon=use_muon, **values)
    if "initial_lr" in options:
        group["initial_lr"] = options["initial_lr"]
    return group


def resolve_ns_coefficients(value: Any) -> str | tuple[float, float, float] | tuple[tuple[float, float, float], ...]:
    """A known name, one ``(a, b, c)``, or a non-empty list of them (one per iteration),
    checked and made immutable."""
    if isinstance(value, str):
        if value not in NS_COEFFICIENT_SETS:
            raise ValueError(
                f"unknown ns_coefficients {value!r}; use one of {sorted(NS_COEFFICIENT_SETS)}, a tuple (a, b, c), "
                "or a list of such tuples (one per iteration)"
            )
        return value
    if _is_triple(value):
        return tuple(float(c) for c in value)  # type: ignore[return-value]
    try:
        triples = list(value)
    except TypeError:
        triples = []
    if triples and all(_is_triple(t) for t in triples):
        return tuple(tuple(float(c) for c in t) for t in triples)  # type: ignore[return-value]
    raise ValueError(
        f"ns_coefficients must be a name from {sorted(NS_COEFFICIENT_SETS)}, three finite numbers (a, b, c), "
        f"or a list of such triples, got {value!r}"
    )


def _is_triple(value: Any) -> bool:
    try:
        items = tuple(value)
    except TypeError:
        return False
    return len(items) == 3 and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in items
    )


def check_ns_dtype(value: Any, where: str = "DMuon") -> str:
    """The name of a Newton-Schulz compute dtype (``"auto"``, ``"bfloat16"``,
    ``"float32"``; ``torch.bfloat16`` and ``torch.float32`` are taken too), or a
    ``ValueError`` naming ``where``."""
    if isinstance(value, torch.dtype) and value in NS_DTYPES.values():
        value = ns_dtype_name(value)
    if value not in NS_DTYPE_CHOICES:
        raise ValueError(
            f"{where}: ns_dtype must be one of {NS_DTYPE_CHOICES}, got {value!r}. \"auto\" uses bfloat16 on "
            "accelerators and on CPUs with a native bf16 matmul, float32 on other CPUs."
        )
    return value


def check_muon_hyperparameters(group: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` for an illegal Muon group value."""
    _check_range(group, "lr", where, low=0.0)
    _check_range(group, "weight_decay", where, low=0.0)
    _check_range(group, "momentum", where, low=0.0, high=1.0, high_open=True)
    _check_range(group, "eps", where, low=0.0, low_open=True)
    _check_range(group, "matched_adamw_rms", where, low=0.0, low_open=True)
    steps = group["ns_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps < MAX_NS_STEPS:
        raise ValueError(f"{where}: ns_steps must be an int in [1, {MAX_NS_STEPS}), got {steps!r}")
    if group["adjust_lr"] not in ADJUST_LR_CHOICES:
        raise ValueError(f"{where}: unknown adjust_lr {group['adjust_lr']!r}; use one of {ADJUST_LR_CHOICES}")
    split_rows = group["split_rows"]
    if split_rows is not None and (not isinstance(split_rows, int) or isinstance(split_rows, bool) or split_rows < 1):
        raise ValueError(f"{where}: split_rows must be None or a positive int, got {split_rows!r}")
    check_bool(group, "nesterov", where)
    check_bool(group, "normuon", where)
    _check_range(group, "normuon_beta2", where, low=0.0, high=1.0, high_open=True)
    check_bool(group, "cautious_weight_decay", where)
    threshold = group["qk_clip_threshold"]
    if threshold is not None and not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
                                      and math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"{where}: qk_clip_threshold must be None (off) or a finite number > 0, the largest "
                         f"attention logit to allow (Kimi K2 used 100), got {threshold!r}")
    if group["ns_algorithm"] not in NS_ALGORITHMS:
        raise ValueError(f"{where}: ns_algorithm must be one of {NS_ALGORITHMS}, got {group['ns_algorithm']!r}. "
                         "\"gram\" runs Gram Newton-Schulz on every matrix, \"auto\" where it costs fewer flops "
                         "(aspect above 1.5), \"standard\" nowhere (torch.optim.Muon's iteration).")
    group["ns_gram_restarts"] = check_gram_restarts(group["ns_gram_restarts"], where)
    try:
        group["ns_coefficients"] = resolve_ns_coefficients(group["ns_coefficients"])
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def check_gram_restarts(value: Any, where: str = "DMuon") -> tuple[int, ...]:
    """``ns_gram_restarts``: the iterations after which Gram Newton-Schulz restarts, as a
    sorted tuple of distinct positive ints (empty: never; one at or after the group's
    last iteration does nothing)."""
    try:
        items = tuple(value)
    except TypeError:
        items = None
    if items is None or isinstance(value, str) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in items) or len(set(items)) != len(items):
        raise ValueError(f"{where}: ns_gram_restarts must be distinct positive ints, the iterations after which Gram "
                         f"Newton-Schulz recomputes X and X X^T (default {DEFAULT_GRAM_RESTARTS}; () for none), "
                         f"got {value!r}")
    return tuple(sorted(items))


def check_adamw_hyperparameters(group: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` for an illegal AdamW group value."""
    _check_range(group, "lr", where, low=0.0)
    _check_range(group, "weight_decay", where, low=0.0)
    _check_range(group, "eps", where, low=0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    group["betas"] = tuple(float(b) for b in betas)
    check_bool(group, "cautious_weight_decay", where)


def check_bool(group: dict[str, Any], key: str, where: str) -> None:
    """An on/off option (``nesterov``, ``normuon``, ``cautious_weight_decay``): True or
    False, not a truthy stand-in such as 1 or "yes"."""
    if not isinstance(group[key], bool):
        raise ValueError(f"{where}: {key} must be a bool (True or False), got {group[key]!r}")


def check_muon_param(param: torch.Tensor, name: str, split_rows: int | None = None) -> None:
    """Raise for a parameter Muon cannot update, saying what to do instead."""
    if param.ndim < 2:
        raise ValueError(
            f"parameter {name!r} has shape {tuple(param.shape)}: Muon needs ndim >= 2; "
            "put it in a param group with use_muon=False (AdamW)"
        )
    if param.is_complex():
        raise ValueError(f"parameter {name!r} is complex: Muon supports real tensors only; use use_muon=False")
    if not param.is_floating_point():
        raise ValueError(f"parameter {name!r} has dtype {param.dtype}: only floating-point parameters can be optimized")
    if split_rows is not None and (param.ndim != 2 or param.shape[0] % split_rows):
        raise ValueError(
            f"parameter {name!r} has shape {tuple(param.shape)}: split_rows={split_rows} needs a 2-D parameter "
            f"whose row count is a multiple of it; put it in a group without split_rows"
        )


def _check_range(
    group: dict[str, Any],
    key: str,
    where: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    value = group[key]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:  # torch.optim's rule: a Tensor lr is one value, of any shape
            raise ValueError(f"{where}: a Tensor {key} must be 1-element (one value), got shape "
                             f"{tuple(value.shape)}; pass a float or a one-element Tensor")
        value = value.item()
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == math.inf else ']'}"
        raise ValueError(f"{where}: {key} must be in {bounds}, got {value!r}")


# ---------------------------------------------------------------- whole-optimizer options
# The options that belong to the whole optimizer, not to a group. Every front end
# (``DMuon(...)``, TorchTitan's ``[optimizer]``) calls these, passing ``where`` (the
# front end's name for itself) so the message is the same apart from that prefix.


def fill_in_variant_defaults(groups: list[dict[str, Any]]) -> None:
    """Give groups loaded from a state_dict written before the update-rule variants
    existed each variant's off value, so they step as they did then (torch's optimizers
    fill in options added after a checkpoint was written the same way)."""
    for group in groups:
        for key in VARIANT_DEFAULTS if group.get("use_muon") else ("cautious_weight_decay",):
            group.setdefault(key, VARIANT_DEFAULTS[key])


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Muon and AdamW group defaults that DMuon's keyword arguments ``options``
    make: the Muon keys as given, and the AdamW part with ``adamw_<x>`` over ``<x>``
    (None: unset). ``options`` needs every key of ``MUON_KEYS`` and ``adamw_betas``,
    ``adamw_eps``; ``adamw_lr``, ``adamw_weight_decay`` and the variants of
    ``VARIANT_DEFAULTS`` may be left out."""
    options = {**VARIANT_DEFAULTS, **options}
    muon = {key: options[key] for key in MUON_KEYS}
    adamw = {
        "lr": options["lr"] if options.get("adamw_lr") is None else options["adamw_lr"],
        "betas": options["adamw_betas"],
        "eps": options["adamw_eps"],
        "weight_decay": options["weight_decay"] if options.get("adamw_weight_decay") is None
        else options["adamw_weight_decay"],
        "cautious_weight_decay": options["cautious_weight_decay"],
    }
    return muon, adamw


def check_comm(value: Any, where: str = "DMuon") -> str:
    """``comm``: one of ``COMM_CHOICES``."""
    if value not in COMM_CHOICES:
        raise ValueError(f"{where}: unknown comm {value!r}; use one of {COMM_CHOICES}")
    return value


def check_max_batch_numel(value: Any, where: str = "DMuon") -> int:
    """``max_batch_numel``: a positive int (it bounds each batch's scratch)."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: max_batch_numel must be a positive int, got {value!r}")
    return value


def check_split_replicas(value: Any, where: str = "DMuon") -> bool | None:
    """``split_replicas``: True, False, or None (the cost model decides)."""
    if value not in (None, True, False):
        raise ValueError(f"{where}: split_replicas must be True, False or None (let the cost model decide), "
                         f"got {value!r}")
    return value


def check_optimizer_options(comm: Any, max_batch_numel: Any, split_replicas: Any, where: str = "DMuon") -> None:
    """The options that are the whole optimizer's, not a group's, in the order DMuon checks them."""
    check_comm(comm, where)
    check_max_batch_numel(max_batch_numel, where)
    check_split_replicas(split_replicas, where)


def check_foreach(value: Any, where: str = "DMuon") -> bool | None:
    """``foreach``: True, False, or None (torch's default for the parameters' device)."""
    if not (value is None or isinstance(value, bool)):
        raise ValueError(f"{where}: foreach must be True, False or None (torch's default for the device), "
                         f"got {value!r}")
    return value


def check_link_gbps(value: Any, name: str, where: str = "DMuon") -> float:
    """A link speed for the cost model (``link_gbps``, ``replica_link_gbps``): a
    positive, finite number of Gbit/s."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{where}: {name} must be a positive finite number of Gbit/s, got {value!r}")
    return float(value)
