"""``python -m benchmarks.vs_distmuon --time`` runs, at a tiny width for 2 steps, and
reports DMuon and TorchTitan 0.3's DistMuon bitwise equal to ``torch.optim.Muon`` at
P = 1 and 2, with the bytes each rank sends as each one's plan says. Not its speed: the
figures belong to a quiet run of the command (docs/vs_distmuon.md).

Skipped unless TorchTitan 0.3.x is installed (DistMuon is 0.3's); the 0.3 leg of
scripts/test_newest_torch.sh runs it.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from tests.titan03_support import require_titan03

require_titan03()

from benchmarks import vs_distmuon_peers  # noqa: E402
from benchmarks.distmuon_model import distmuon_owners, whole_matrix_exchange_bytes  # noqa: E402
from benchmarks.vs_distmuon import main  # noqa: E402
from benchmarks.vs_distmuon_tables import timed_header, timed_table  # noqa: E402
from benchmarks.vs_distmuon_time import Settings, run_timed  # noqa: E402

WIDTH, BLOCKS, HIDDEN = 64, 2, 256  # HIDDEN: benchmarks.bench_workload.ffn_hidden(64)
ARGV = ["--time", "--json", "--width", str(WIDTH), "--blocks", str(BLOCKS), "--steps", "2", "--warmup", "1",
        "--world-sizes", "1", "2", "--optimizers", "dmuon", "distmuon", "--timeout", "300"]


@pytest.fixture(scope="module")
def report() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(ARGV)
    return json.loads(out.getvalue())


def _rows(report: dict) -> dict[tuple[int, str], dict]:
    return {(row["world_size"], row["optimizer"]): row for world in report["worlds"] for row in world["rows"]}


def _matrices() -> list[tuple[str, tuple[int, int]]]:
    """The stack's matrices as DistMuon sees them: TorchTitan FQNs, in model order."""
    shapes = {"wq": (WIDTH, WIDTH), "wk": (WIDTH, WIDTH), "wv": (WIDTH, WIDTH), "wo": (WIDTH, WIDTH),
              "w1": (HIDDEN, WIDTH), "w2": (WIDTH, HIDDEN), "w3": (HIDDEN, WIDTH)}
    return [(vs_distmuon_peers.titan_fqn(f"{block}.{name}.weight"), shape)
            for block in range(BLOCKS) for name, shape in shapes.items()]


@pytest.mark.multirank
def test_both_agree_bitwise_with_torch_optim_muon_at_one_and_two_ranks(report):
    rows = _rows(report)
    assert set(rows) == {(p, name) for p in (1, 2) for name in ("dmuon", "distmuon")}
    for row in rows.values():
        assert row["max_abs_diff"] == 0.0 and row["bitwise"], row


@pytest.mark.multirank
def test_each_row_has_its_time_floor_and_efficiency(report):
    for row in _rows(report).values():
        assert row["step_ms"] > 0 and row["one_rank_ms"] > 0
        assert row["floor_ms"] == pytest.approx(row["one_rank_ms"] / row["world_size"])
        assert row["efficiency"] == pytest.approx(row["floor_ms"] / row["step_ms"])


@pytest.mark.multirank
def test_bytes_sent_are_each_plans_own(report):
    rows = _rows(report)
    assert rows[1, "dmuon"]["bytes_sent_max"] == rows[1, "distmuon"]["bytes_sent_max"] == 0
    matrices = _matrices()
    elements = sum(math.prod(shape) for _, shape in matrices)
    # DMuon: the owner-exchange minimum in bf16, 4 N (P - 1) / P^2, on every rank.
    minimum = 4 * elements * (2 - 1) // 2**2
    assert [c["all_to_all_single"] for c in rows[2, "dmuon"]["bytes_by_collective"]] == [minimum] * 2
    # DistMuon: fp32, whole matrices to the owners its planner picks (benchmarks.distmuon_model).
    owners = distmuon_owners(matrices, 2, "per_layer")
    sent, _received = whole_matrix_exchange_bytes([shape for _, shape in matrices], owners, 2, element_size=4)
    assert [c.get("all_to_all_single", 0) for c in rows[2, "distmuon"]["bytes_by_collective"]] == sent


@pytest.mark.multirank
def test_the_report_records_how_and_where_it_was_measured(report):
    assert report["command"].startswith("python -m benchmarks.vs_distmuon --time")
    assert report["date"] and report["machine"]["cores"] >= 1
    assert report["machine"]["cpu_capability"] and report["machine"]["torchtitan"].startswith("0.3")
    assert report["hyperparameters"] == vs_distmuon_peers.HYPERPARAMETERS
    table = timed_table(report)
    assert table.count("\n") == 1 + 4 and "| 2 | DistMuon (TorchTitan 0.3) |" in table
    assert "CPU capability" in timed_header(report)


@pytest.mark.unit
def test_an_optimizer_that_does_not_import_is_reported_absent_not_failed(monkeypatch):
    monkeypatch.setitem(vs_distmuon_peers.REQUIRES, "dion", ("no_such_module_for_dion", "a checkout"))
    report = run_timed(Settings(world_sizes=(), optimizers=("dion",)), [])  # no launch
    assert report["skipped"]["dion"].startswith("absent: No module named 'no_such_module_for_dion'")
    assert report["worlds"] == []
