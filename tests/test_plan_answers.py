"""The owner plan gives the same public answers as before it kept only what one rank needs:
units, blocks, owners, sources, batches, splits, buffer layouts, local blocks, bytes,
scratch and predicted times, for every rank of nine small layouts (FSDP rows and columns,
uneven and empty shards, experts, 4-D weights, heads, HSDP split and apart, FSDP over TP,
meshes whose positions hold the plan ranks out of order), compared with
``tests/data/plan_answers.json`` (``tests/data/make_plan_answers.py``, commit 264f828). One
deliberate change since: a last batch far shorter than the others joins the one before it
(``dmuon.plan.batches``), so ``mixed-P4``'s batches and what follows from them (per-batch
layouts, per-rank bytes and scratch, predicted times) were rewritten with that rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.plan_answers import CASES, case_answers

pytestmark = pytest.mark.unit

ANSWERS = Path(__file__).parent / "data" / "plan_answers.json"


@pytest.fixture(scope="module")
def before() -> dict:
    return json.loads(ANSWERS.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_answers_as_it_did_before(name, before):
    now = json.loads(json.dumps(case_answers(name)))  # tuples as lists, as JSON gave them back
    for key in before[name]:
        assert now[key] == before[name][key], key
