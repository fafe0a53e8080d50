"""How scripts/test.sh spreads the suite over two pytest-xdist workers (tests/conftest.py):
the multi-rank tests run in one worker and the torchrun tests in the other, each kind one
launch at a time, and the in-process tests fill both. Checked on a small generated suite,
in a pytest of its own, so that an upgrade that silently drops the groups (pytest 9 with
pytest-xdist 3.8 does: pyproject.toml) fails here instead of making the suite slower."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

SUITE = '''
import pytest

@pytest.mark.multirank
@pytest.mark.parametrize("n", range(4))
def test_ranks(n):
    pass

@pytest.mark.torchrun
@pytest.mark.parametrize("n", range(4))
def test_torchrun(n):
    pass

@pytest.mark.unit
@pytest.mark.parametrize("n", range(8))
def test_unit(n):
    pass
'''


def _workers_by_kind(folder: Path) -> dict[str, set[str]]:
    (folder / "test_generated.py").write_text(SUITE)
    (folder / "conftest.py").write_text(f"from tests.conftest import *  # noqa: F401,F403\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                          "no:cacheprovider", "--rootdir", str(folder), "-c", str(REPO / "pyproject.toml"),
                          str(folder)], capture_output=True, text=True, timeout=240, cwd=REPO).stdout
    found: dict[str, set[str]] = {}
    for worker, kind in re.findall(r"\[(gw\d)\].*PASSED .*::test_(ranks|torchrun|unit)\[", out):
        found.setdefault(kind, set()).add(worker)
    assert sum(1 for _ in re.finditer(r" PASSED ", out)) == 16, out[-3000:]
    return found


def test_each_launching_kind_runs_in_one_worker_and_the_two_kinds_in_different_ones(tmp_path):
    found = _workers_by_kind(tmp_path)
    assert len(found["ranks"]) == 1 and len(found["torchrun"]) == 1, found
    assert found["ranks"] != found["torchrun"], found
