"""The legal values of DMuon's options, checked with errors that name the option, the
group (or front end) and what to do: the group hyperparameters first, then the options
of the whole optimizer.

Every front end (``DMuon(...)``, TorchTitan's ``[optimizer]`` fields and 0.3.x's config)
calls these, passing ``where`` (its name for itself), so a message differs only by that
prefix.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dmuon.numerics.newton_schulz import (
    DEFAULT_GRAM_RESTARTS,
    MAX_NS_STEPS,
    NS_ALGORITHMS,
    NS_COEFFICIENT_SETS,
    NS_DTYPE_CHOICES,
    NS_DTYPES,
    ns_dtype_name,
)
from dmuon.numerics.momentum_storage import parse_momentum_dtype
from dmuon.numerics.update_rules import ADJUST_LR_CHOICES
from dmuon.plan.paths import COMM_CHOICES


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
        group["momentum_dtype"] = parse_momentum_dtype(group["momentum_dtype"])
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
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


def check_hyperparameter_defaults(muon: dict[str, Any], adamw: dict[str, Any]) -> None:
    """DMuon's keyword defaults of its Muon and AdamW parts (each group's are checked when it is made)."""
    check_muon_hyperparameters(dict(muon), "DMuon")
    check_adamw_hyperparameters(dict(adamw), "DMuon (AdamW part)")


def check_bool(group: dict[str, Any], key: str, where: str) -> bool:
    """An on/off option (``nesterov``, ``normuon``, ``skip_nonfinite``...): True or
    False, not a truthy stand-in such as 1 or "yes"; returned."""
    if not isinstance(group[key], bool):
        raise ValueError(f"{where}: {key} must be a bool (True or False), got {group[key]!r}")
    return group[key]


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
    # Finite: an infinite lr, decay or epsilon turns the weights NaN within a few steps.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == math.inf else ']'}"
        raise ValueError(f"{where}: {key} must be in {bounds}, got {value!r}")


# ---------------------------------------------------------------- whole-optimizer options
# The options that belong to the whole optimizer, not to a group. Every front end
# (``DMuon(...)``, TorchTitan's ``[optimizer]``) calls these, passing ``where`` (the
# front end's name for itself) so the message is the same apart from that prefix.


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


def check_optimizer_options(comm: Any, max_batch_numel: Any, split_replicas: Any,
                            where: str = "DMuon") -> tuple[str, int, bool | None]:
    """The options that are the whole optimizer's, not a group's, in the order DMuon checks
    them; returned."""
    check_comm(comm, where)
    check_max_batch_numel(max_batch_numel, where)
    check_split_replicas(split_replicas, where)
    return comm, max_batch_numel, split_replicas


def check_link_gbps(value: Any, name: str, where: str = "DMuon") -> float:
    """A link speed for the cost model (``link_gbps``, ``replica_link_gbps``): a
    positive, finite number of Gbit/s."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{where}: {name} must be a positive finite number of Gbit/s, got {value!r}")
    return float(value)
