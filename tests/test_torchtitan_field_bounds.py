"""Every bound of every number in TorchTitan 0.2's ``[optimizer]`` section, at both ends,
open and closed: a value at the bound, the next float (or int) inside it, and the next
outside, each parsed as a job would parse it (``ConfigManager.parse_args``, which runs the
extension's checks). An accepted value parses unchanged; a refused one is refused at
parse time, by the check of its own field (the message names it and quotes the value).

The cases are generated from the checks' tables: ``validation.NUMBER_FIELDS`` (the fields
the extension checks as written: ``adamw_lr``, ``beta1``, ``beta2``) and, for the numbers
dmuon's validator checks (``dmuon/options/checks.py``, which calls one range check per option and
keeps no table), ``DMUON_CHECKED`` below, the specification of those ranges as the TOML
sees them. ``test_every_number_field_has_its_bounds_here`` keeps the tables whole.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys

import pytest
from torchtitan.config import ConfigManager

from dmuon.numerics.newton_schulz import MAX_NS_STEPS
from torchtitan_ext.field_checks import INF, Interval, NON_NEGATIVE, POSITIVE, UNIT
from torchtitan_ext.titan02.validation import NUMBER_FIELDS

pytestmark = pytest.mark.unit

EXT = ["--job.custom_config_module", "torchtitan_ext", "--experimental.custom_import", "torchtitan_ext.titan02.job",
       "--optimizer.name", "DMuon"]

# The [optimizer] numbers dmuon's own validator checks, where each may lie as TOML writes it.
DMUON_CHECKED: dict[str, Interval] = {
    "lr": NON_NEGATIVE,                 # the Muon part's (and AdamW's, without adamw_lr)
    "weight_decay": NON_NEGATIVE,
    "eps": NON_NEGATIVE,                # the AdamW part's epsilon
    "momentum": UNIT,
    "normuon_beta2": UNIT,
    "matched_adamw_rms": POSITIVE,
    "qk_clip_threshold": NON_NEGATIVE,  # 0 is off in TOML (DMuon's None); on: finite and > 0
    "link_gbps": POSITIVE,
    "replica_link_gbps": POSITIVE,
}
INTEGER_FIELDS: dict[str, Interval] = {"ns_steps": Interval(1, MAX_NS_STEPS, high_open=True)}
BOUNDS: dict[str, Interval] = {**NUMBER_FIELDS, **DMUON_CHECKED, **INTEGER_FIELDS}


def _edges(field: str, interval: Interval) -> list[tuple[str, float | int, bool]]:
    """(case id, value, accepted) at each end of ``interval``: at the bound, the next
    representable value inside and outside; an unbounded end gets the largest finite
    value (in) and infinity (out: numbers must be finite)."""
    if field in INTEGER_FIELDS:
        def step(x, toward):
            return int(x) + (1 if toward > x else -1)
    else:
        step = math.nextafter
    low, high = interval.low, interval.high
    cases = [(f"{field}-at-low-{'open' if interval.low_open else 'closed'}", low, not interval.low_open),
             (f"{field}-just-above-low", step(low, INF), True),
             (f"{field}-just-below-low", step(low, -INF), False)]
    if high == INF:
        cases += [(f"{field}-largest-finite", sys.float_info.max, True), (f"{field}-infinite", INF, False)]
    else:
        cases += [(f"{field}-at-high-{'open' if interval.high_open else 'closed'}", high, not interval.high_open),
                  (f"{field}-just-below-high", step(high, -INF), True),
                  (f"{field}-just-above-high", step(high, INF), False)]
    if field in INTEGER_FIELDS:
        cases = [(case, int(value), ok) for case, value, ok in cases if value not in (INF, sys.float_info.max)]
    return cases


CASES = [(field, value, ok) for field, interval in BOUNDS.items() for _, value, ok in _edges(field, interval)]
IDS = [case for field, interval in BOUNDS.items() for case, _, _ in _edges(field, interval)]


def _parse(field: str, value: float | int):
    return ConfigManager().parse_args([*EXT, f"--optimizer.{field}={value!r}"])


@pytest.mark.parametrize(("field", "value", "accepted"), CASES, ids=IDS)
def test_a_value_at_or_beside_a_bound_is_taken_or_refused_by_its_own_fields_check(field, value, accepted):
    if accepted:
        assert getattr(_parse(field, value).optimizer, field) == value
        return
    with pytest.raises(ValueError) as error:
        _parse(field, value)
    message = str(error.value)
    assert re.search(rf"(^|[\s:]){field} must", message) and f"got {value!r}" in message, message


def test_every_number_field_has_its_bounds_here():
    """Each int or float field of DMuon's [optimizer] (the extension's and TorchTitan's
    own that DMuon reads) is in a table above: a new number field needs its bounds."""
    optimizer = ConfigManager().parse_args(EXT).optimizer
    numbers = {f.name for f in dataclasses.fields(optimizer)
               if isinstance(getattr(optimizer, f.name), (int, float)) and not isinstance(getattr(optimizer, f.name), bool)
               or f.name in NUMBER_FIELDS}
    assert numbers == set(BOUNDS)

