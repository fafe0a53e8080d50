"""``python -m benchmarks.replay_guard`` runs and times this tree's guard beside a revision's
(docs/benchmark.md, "Replay guard"): a small run, its output checked, not its times."""

from __future__ import annotations

import pytest

from benchmarks import replay_guard

pytestmark = pytest.mark.unit


def test_the_replay_guard_benchmark_times_this_tree_and_a_revision(capsys):
    assert replay_guard.main(["--params", "10", "--repeats", "10", "--against", "HEAD"]) == 0
    out = capsys.readouterr().out
    assert "on 32 guarded tensors (10 Muon matrices)" in out
    assert "this tree: median" in out and "HEAD: median" in out
