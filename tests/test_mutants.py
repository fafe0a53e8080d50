"""The mutation suite's catalogue stays in step with the code (issue 52): every mutant
still applies (its ``old`` text occurs once in its file), says which guarantee it breaks,
and names tests that exist. Running the mutants is ``python -m tests.mutants`` (not CI:
about 20 minutes; docs/development.md, "The mutation suite")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutants import catalogue
from tests.mutants.__main__ import first_failure

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
MUTANTS = catalogue()


def test_the_catalogue_holds_at_least_forty_mutants_with_unique_names():
    assert len(MUTANTS) >= 40
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_a_mutant_still_applies_names_its_guarantee_and_tests_that_exist(mutant):
    assert (REPO / mutant.path).read_text().count(mutant.old) == 1, "the code moved: update the mutant"
    assert mutant.old != mutant.new and mutant.guarantee
    files = [arg.split("::")[0] for arg in mutant.tests if arg.startswith("tests/")]
    assert files and all((REPO / f).is_file() for f in files)


def test_a_run_reports_the_first_failing_test():
    output = "..F\nFAILED tests/test_x.py::test_y[a] - AssertionError\nFAILED tests/test_x.py::test_z\n"
    assert first_failure(output) == "tests/test_x.py::test_y[a]"
