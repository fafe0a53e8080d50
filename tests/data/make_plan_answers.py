"""Writes tests/data/plan_answers.json: every public answer of the owner plans of
``tests/plan_answers.py``'s cases, as the plan gave them before it kept only what one rank
needs (commit 264f828). tests/test_plan_answers.py compares today's with them. Run once,
from the repository root, on that commit: ``python tests/data/make_plan_answers.py``."""

import json

from tests.plan_answers import CASES, case_answers

with open("tests/data/plan_answers.json", "w") as f:
    json.dump({name: case_answers(name) for name in CASES}, f, separators=(",", ":"))
    f.write("\n")
