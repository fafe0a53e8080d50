"""Every combination of DMuon's step switches, each checked against one reference.

The matrix (built and run by tests/combination_scenarios.py):
capturable {off, on} x implementation {for-loop, foreach, fused AdamW} x variant {plain,
normuon, cautious weight decay, QK-clip} x parameter dtype {fp32, bf16} x fault {none, NaN
in a Muon grad, inf in an AdamW grad, an invalid (float64) AdamW grad} x P {1 process, 2
gloo ranks: ``Shard(0)`` DTensors, the fault on one rank only} x momentum kept in {the
parameter's dtype, bf16, int8} x the AdamW moments kept in {the parameter's dtype, bf16,
int8} (``adamw_state_dtype``: the embedding's; the bias keeps its dtype), less capturable +
foreach, which DMuon refuses on the CPU at construction: 2,880 combinations. The model: two
8x6 attention projections and a 2x4x6 expert stack (Muon), a bias and a 9x6 embedding
(AdamW), weight decay 0.1 on both parts at every step, the faulty one included.

The specification, for each combination:
- a skipped step (NaN/inf with ``skip_nonfinite``) or a refused one (the invalid grad:
  ``ValueError``) changes no bit of the parameters or of ``state_dict()``;
- every rank skips it (``skipped_steps`` counts it) or raises as documented: the faulty
  rank at once, naming the parameter, every rank at the next step (which changes nothing);
- the run after it equals the same run without it, bit for bit;
- ``capturable=True`` equals ``capturable=False``, bit for bit where docs/optimizer.md
  ("Capturable") says so, and within its stated roundings for bf16 elsewhere.

By default a sample runs: every capturable + fused combination with a fault and momentum and
AdamW moments in the parameter's dtype (where a skipped step once still decayed the AdamW
part, fixed by commit e19a371), then, greedily, combinations until every pair of two
switches' values appears at least once: 61 combinations, 222 tests, about 20 s on 2 idle
cores (55 s beside other work). The full matrix (7,632 tests, 7 minutes on 2 cores beside
other work):

    DMUON_ALL_COMBINATIONS=1 .venv/bin/python -m pytest tests/test_switch_combinations.py -p no:cacheprovider
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests import combination_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # bitwise comparisons: one reduction order

SEAM = [c for c in scenarios.every_combination() if c.capturable and c.implementation == "fused"
        and c.fault != "none" and c.momentum == "param" and c.adamw_state == "param"]
COMBINATIONS = (scenarios.every_combination() if os.environ.get("DMUON_ALL_COMBINATIONS") == "1"
                else scenarios.pairwise_sample(SEAM))


def _case(c: scenarios.Combination) -> Any:
    """A case named for its combination; P = 2 ones launch ranks (``multirank``)."""
    return pytest.param(c, id=c.name, marks=[pytest.mark.unit if c.world == 1 else pytest.mark.multirank])


@pytest.fixture(scope="module")
def on_two_ranks() -> list[dict[str, dict[str, str | None]]]:
    """Each rank's answers for every P = 2 combination of this session: one launch."""
    return run_on_ranks(scenarios.checks_on_ranks, 2, [c for c in COMBINATIONS if c.world == 2], timeout=600)


@pytest.fixture
def answers(request: pytest.FixtureRequest, combination: scenarios.Combination) -> list[dict[str, str | None]]:
    """Each rank's answer to each check for ``combination`` (None: held)."""
    if combination.world == 1:
        return [scenarios.checks(combination)]
    return [rank[combination.name] for rank in request.getfixturevalue("on_two_ranks")]


def _held(answers: list[dict[str, str | None]], check: str) -> None:
    assert [rank[check] for rank in answers] == [None] * len(answers), f"{check}, by rank"


FAULTY = [_case(c) for c in COMBINATIONS if c.fault != "none"]


@pytest.mark.parametrize("combination", FAULTY)
def test_a_skipped_or_refused_step_changes_no_bit(answers: list[dict[str, str | None]]) -> None:
    # Parameters and the whole state_dict() (state tensors, step counts, param_groups), on
    # every rank, before the faulty step against after it and after each step that raised.
    _held(answers, "unchanged")


@pytest.mark.parametrize("combination", FAULTY)
def test_every_rank_skips_or_raises_as_documented(answers: list[dict[str, str | None]]) -> None:
    # NaN/inf: no error and skipped_steps == 1 on every rank. Invalid: the faulty rank's
    # ValueError names the parameter; at P = 2 every rank raises ValueError at the next step.
    _held(answers, "errors")


@pytest.mark.parametrize("combination", FAULTY)
def test_the_run_after_a_faulty_step_equals_the_run_without_it(answers: list[dict[str, str | None]]) -> None:
    # Good steps 0, 1, 2 with the faulty step after 0, against 0, 1, 2 alone (same options):
    # a skipped step must not count in AdamW's step counters either.
    _held(answers, "without")


CAPTURABLE = [_case(c) for c in COMBINATIONS if c.capturable]


@pytest.mark.parametrize("combination", CAPTURABLE)
def test_capturable_equals_not_capturable_bit_for_bit(answers: list[dict[str, str | None]]) -> None:
    # The final parameters and state against the same combination with capturable=False
    # (bf16 parameters within one rounding a step where docs/optimizer.md says so: checks()).
    _held(answers, "capturable")
