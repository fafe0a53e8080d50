"""The legal values of DMuon's options, each checked by one function with an error that
names the option, the group (or front end) and what to do: the group options first, then
the whole optimizer's. Which check an option gets is its row of ``dmuon.options.table``.

Every front end (``DMuon(...)``, TorchTitan's ``[optimizer]`` fields and 0.3.x's config)
calls these through the table, passing ``where`` (its name for itself), so a message differs
only by that prefix. A group option's check is ``check(value, key, where)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dmuon.numerics.newton_schulz import (DEFAULT_GRAM_RESTARTS, MAX_NS_STEPS, NS_ALGORITHMS, NS_COEFFICIENT_SETS,
                                          NS_DTYPE_CHOICES, NS_DTYPES, ns_dtype_name)
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


def _finite(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_triple(value: Any) -> bool:
    try:
        items = tuple(value)
    except TypeError:
        return False
    return len(items) == 3 and all(_finite(c) for c in items)


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


def in_range(low: float, high: float = math.inf, low_open: bool = False,
             high_open: bool = False) -> Callable[[Any, str, str], Any]:
    """A check that a number (or a one-element Tensor, torch.optim's rule for ``lr``) is
    finite and within the bounds; the value is kept as given."""
    def check(value: Any, key: str, where: str) -> Any:
        number = value
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:  # torch.optim's rule: a Tensor lr is one value, of any shape
                raise ValueError(f"{where}: a Tensor {key} must be 1-element (one value), got shape "
                                 f"{tuple(value.shape)}; pass a float or a one-element Tensor")
            number = value.item()
        # Finite: an infinite lr, decay or epsilon turns the weights NaN within a few steps.
        ok = _finite(number) and (number > low if low_open else number >= low) and (number < high if high_open else number <= high)
        if not ok:
            bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == math.inf else ']'}"
            raise ValueError(f"{where}: {key} must be in {bounds}, got {number!r}")
        return value
    return check


def optional(check: Callable[[Any, str, str], Any]) -> Callable[[Any, str, str], Any]:
    """``check``, or None (unset)."""
    return lambda value, key, where: value if value is None else check(value, key, where)


def check_bool(value: Any, key: str, where: str) -> bool:
    """An on/off option (``nesterov``, ``normuon``, ``skip_nonfinite``...): True or
    False, not a truthy stand-in such as 1 or "yes"; returned."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be a bool (True or False), got {value!r}")
    return value


def check_ns_steps(value: Any, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < MAX_NS_STEPS:
        raise ValueError(f"{where}: ns_steps must be an int in [1, {MAX_NS_STEPS}), got {value!r}")
    return value


def check_adjust_lr(value: Any, key: str, where: str) -> str | None:
    if value not in ADJUST_LR_CHOICES:
        raise ValueError(f"{where}: unknown adjust_lr {value!r}; use one of {ADJUST_LR_CHOICES}")
    return value


def check_split_rows(value: Any, key: str, where: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{where}: split_rows must be None or a positive int, got {value!r}")
    return value


def check_qk_clip_threshold(value: Any, key: str, where: str) -> float | None:
    if value is not None and not (_finite(value) and value > 0):
        raise ValueError(f"{where}: qk_clip_threshold must be None (off) or a finite number > 0, the largest "
                         f"attention logit to allow (Kimi K2 used 100), got {value!r}")
    return value


def check_ns_algorithm(value: Any, key: str, where: str) -> str:
    if value not in NS_ALGORITHMS:
        raise ValueError(f"{where}: ns_algorithm must be one of {NS_ALGORITHMS}, got {value!r}. "
                         "\"gram\" runs Gram Newton-Schulz on every matrix, \"auto\" where it costs fewer flops "
                         "(aspect above 1.5), \"standard\" nowhere (torch.optim.Muon's iteration).")
    return value


def _where_first(resolve: Callable[[Any], Any]) -> Callable[[Any, str, str], Any]:
    """``resolve(value)`` as a check: its ``ValueError`` prefixed with ``where``."""
    def check(value: Any, key: str, where: str) -> Any:
        try:
            return resolve(value)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    return check


def check_momentum_dtype(value: Any, key: str, where: str) -> str | None:
    """The name of a kept state's form (``momentum_dtype``, an AdamW group's ``state_dtype``;
    a ``torch.dtype`` is taken too), or None."""
    return _where_first(lambda v: parse_momentum_dtype(v, key))(value, key, where)
check_ns_coefficients = _where_first(resolve_ns_coefficients)


def check_betas(value: Any, key: str, where: str) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(
            isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in value):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {value!r}")
    return tuple(float(b) for b in value)  # type: ignore[return-value]


def check_gram_restarts(value: Any, key: str, where: str) -> tuple[int, ...]:
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


# ---------------------------------------------------------------- whole-optimizer options


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


def check_link_gbps(value: Any, name: str, where: str = "DMuon") -> float:
    """A link speed for the cost model (``link_gbps``, ``replica_link_gbps``): a
    positive, finite number of Gbit/s."""
    if not (_finite(value) and value > 0):
        raise ValueError(f"{where}: {name} must be a positive finite number of Gbit/s, got {value!r}")
    return float(value)
