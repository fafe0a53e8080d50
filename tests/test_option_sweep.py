"""Every option through every front end and every resume (issue 67, item 1): a fixed sample of
``tests.option_sweep`` (every option through each of its front ends, with its changed and its bad value), run in a process
of its own (its owner-exchange cases make a fake process group). Any number more:
``python -m tests.option_sweep --cases N --seed S``; a failure's id reruns it alone.

The generator's own rules are unit tests here too: ids that name their case, a sample that
draws every (option, front end) pair, and front ends derived from each option's row."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from dmuon.options.table import OPTIONS, OnResume, Scope
from tests import launch
from tests.option_sweep import BAD, CHANGED
from tests.option_sweep import FRONTS, all_cases, count, fronts_of, parse, sample, values_of

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
# Two rounds over every (option, front end) pair: each with its changed value, then its bad
# value (tests.option_sweep.sample); about 30 s on 2 cores.
PAIRS = [(o.name, f) for o in OPTIONS for f in fronts_of(o.name)]
SAMPLE_CASES, SAMPLE_SEED = 2 * len(PAIRS), 67


def test_a_sample_of_every_option_through_every_front_end_and_resume_holds():
    proc = launch.run([sys.executable, "-m", "tests.option_sweep", "--cases", str(SAMPLE_CASES),
                       "--seed", str(SAMPLE_SEED)], timeout_s=300, cwd=REPO)
    closing = re.search(r"^(\d+) passed, (\d+) failed, (\d+) skipped$", proc.stdout, flags=re.MULTILINE)
    assert proc.returncode == 0 and closing and closing.group(2) == "0", proc.stdout[-4000:]
    assert int(closing.group(1)) >= SAMPLE_CASES // 2, proc.stdout[-2000:]  # most cases ran, not skipped


def test_a_case_id_names_its_case():
    for case in sample(300, 1):
        assert parse(case.id) == case
    with pytest.raises(ValueError, match="not an option-sweep case id"):
        parse("lr-nowhere-v0-s1")


def test_the_sample_draws_every_option_through_each_of_its_front_ends_with_its_changed_and_bad_value():
    drawn = {(c.option, c.front, values_of(c.option)[c.value]) for c in sample(SAMPLE_CASES, SAMPLE_SEED)}
    for name, front in PAIRS:
        for value in (CHANGED.get(name, BAD[name]), BAD[name]):
            assert (name, front, value) in drawn


def test_each_options_front_ends_follow_its_row():
    for option in OPTIONS:
        fronts = fronts_of(option.name)
        assert set(fronts) <= set(FRONTS)
        assert ("split" in fronts) == (option.scope is not Scope.OPTIMIZER)
        assert ("titan02" in fronts) == (option.titan02 == option.name)
        assert ("resume_converted" in fronts) == (option.on_resume is OnResume.CONVERTED)
        assert {"kwargs", "capture"} <= set(fronts)
        assert values_of(option.name)[0] == option.default or option.default is None


def test_count_is_the_number_of_cases_the_generator_knows():
    assert count() == sum(1 for _ in all_cases())
