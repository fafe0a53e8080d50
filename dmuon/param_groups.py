"""Turning DMuon's ``params`` argument into validated param groups.

Kept apart from the step so that the rules a user meets first (which parameter gets
which algorithm, which values are legal) read in one place.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from dmuon.newton_schulz import MAX_NS_STEPS, NS_COEFFICIENT_SETS, NS_DTYPE_CHOICES, NS_DTYPES, ns_dtype_name
from dmuon.update_rules import ADJUST_LR_CHOICES

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
    "eps",
    "adjust_lr",
    "matched_adamw_rms",
    "split_rows",
)
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def default_use_muon(name: str | None, param: torch.Tensor, adamw_name_pattern: str = DEFAULT_ADAMW_NAME_PATTERN) -> bool:
    """The default routing: Muon for real ndim >= 2 tensors, unless ``name`` matches
    ``adamw_name_pattern``."""
    if param.ndim < 2 or param.is_complex():
        return False
    return name is None or re.search(adamw_name_pattern, name) is None


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
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"{where}: nesterov must be a bool, got {group['nesterov']!r}")
    try:
        group["ns_coefficients"] = resolve_ns_coefficients(group["ns_coefficients"])
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def check_adamw_hyperparameters(group: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` for an illegal AdamW group value."""
    _check_range(group, "lr", where, low=0.0)
    _check_range(group, "weight_decay", where, low=0.0)
    _check_range(group, "eps", where, low=0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    group["betas"] = tuple(float(b) for b in betas)


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
