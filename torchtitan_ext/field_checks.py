"""Checks of single config fields, by the name the user wrote, for both TorchTitan lines.

dmuon's own validator names DMuon's keywords (``lr`` of the AdamW part, ``betas``), which is
not what a TorchTitan user wrote (``adamw_lr``, ``beta2``); and a TOML value is taken as it
is parsed, so ``telemetry = "false"`` would be a truthy string. These run first, on each
field as written, so the message names that field and its legal values. Imports nothing
from TorchTitan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

INF = math.inf


@dataclass(frozen=True)
class Interval:
    """Where a number may lie: ``[low, high]``, either end open."""

    low: float
    high: float = INF
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        high_open = self.high_open or self.high == INF
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if high_open else ']'}"


NON_NEGATIVE = Interval(0.0)
POSITIVE = Interval(0.0, low_open=True)
UNIT = Interval(0.0, 1.0, high_open=True)  # EMA coefficients, betas, momentum


def is_number(value: Any) -> bool:
    """An int or float that is not a bool (TOML's ``true`` is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(value: Any, field: str, where: str, interval: Interval, note: str = "") -> None:
    """``value`` must be a finite number in ``interval``; the message names ``field``."""
    if not (is_number(value) and math.isfinite(value) and value in interval):
        raise ValueError(f"{where} {field} must be a finite number in {interval}{note}, got {value!r}")


def check_flag(value: Any, field: str, where: str, spelling: str = "true or false") -> None:
    """An on/off field takes a boolean only: a string such as ``"false"`` or a number
    such as ``1`` is refused rather than read by its truthiness."""
    if not isinstance(value, bool):
        raise ValueError(f"{where} {field} must be {spelling} (a boolean, not a string or a number), "
                         f"got {value!r}")
