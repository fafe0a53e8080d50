"""At P = 1 every DTensor parameter is whole on its one rank: DMuon steps it with the
bits of a single process, on the local path with the default ``comm="all_to_all"``
(there is no one to exchange with) and on the reference path (a one-rank
``redistribute``) with ``comm="redistribute"``.

The scenarios of the multi-rank exactness tests (``tests/distributed_scenarios.py``;
``test_distributed_exactness.py`` and ``test_distributed_scale_out.py`` run them at
P = 2 and 4), run here in this process on a one-rank gloo group: the base cases in both
compute dtypes (``comm`` all_to_all and redistribute), NorMuon with cautious weight decay
(split_rows included), Gram Newton-Schulz, and the block layouts and attention heads of
the scale-out tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests import distributed_scenarios as scenarios

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_gloo", "one_thread")]

LAYOUT_CASES = [name for name, _, _ in scenarios.LAYOUT_CASES]
HEAD_CASES = [name for name, _, _ in scenarios.HEAD_CASES]
DEFAULT_CAP = 1 << 27


# The path a Shard(0) matrix takes on one rank, per ``comm``.
ONE_RANK_PATH = {"all_to_all": "local", "redistribute": "redistribute"}
Figures = tuple[dict[str, bool], dict[str, set[str]]]


def _exactness_figures(figures: dict[Any, Any]) -> Figures:
    """``(flags, paths)`` of an exactness scenario: every bitwise-equality flag, per run
    and case, and per ``comm`` every path its runs took."""
    flags: dict[str, bool] = {}
    paths: dict[str, set[str]] = {}
    for key, value in figures.items():
        if len(key) == 2 or key[-1] == "moments":  # (layout, comm), ("split_rows", comm), NorMuon state
            flags.update({f"{key}: {case}": ok for case, ok in value.items()})
        elif key[-1] == "paths":
            paths.setdefault(key[1], set()).update(value.values())
    return flags, paths


def _layout_figures(figures: dict[str, Any]) -> Figures:
    """The same of a layout scenario (``comm`` left at its default, all_to_all)."""
    return figures["equal"], {"all_to_all": set(figures["paths"].values())}


SCENARIOS: dict[str, Callable[[], Figures]] = {
    **{f"base_{dtype}": lambda dtype=dtype: _exactness_figures(scenarios.exactness(dtype))
       for dtype in scenarios.NS_DTYPES},
    **{f"normuon_{dtype}": lambda dtype=dtype: _exactness_figures(scenarios.variants_exactness(dtype))
       for dtype in scenarios.NS_DTYPES},
    "gram": lambda: _exactness_figures(scenarios.exactness("float32", "gram")),
    **{f"block_layouts_{dtype}": lambda dtype=dtype: _layout_figures(
        scenarios.layout_exactness(LAYOUT_CASES, DEFAULT_CAP, ns_dtype=dtype)) for dtype in scenarios.NS_DTYPES},
    **{f"heads_{algorithm}": lambda algorithm=algorithm: _layout_figures(
        scenarios.layout_exactness(HEAD_CASES, DEFAULT_CAP, 4, ns_algorithm=algorithm))
       for algorithm in ("standard", "gram")},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_one_rank_steps_the_bits_of_a_single_process_on_the_local_path_or_the_one_comm_asks_for(scenario):
    flags, paths = SCENARIOS[scenario]()
    assert flags and [k for k, ok in flags.items() if not ok] == []
    assert paths and paths == {comm: {ONE_RANK_PATH[comm]} for comm in paths}
