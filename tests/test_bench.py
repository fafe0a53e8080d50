"""benchmarks.bench runs end to end and reports what docs/benchmark.md promises (not speed:
speed lives in the benchmark itself)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench, bench_workload
from benchmarks.bench import parse_args
from benchmarks.bench_report import format_table
from benchmarks.bench_workload import BF16_ROWS, OPTIMIZERS, ffn_hidden, slow_bf16_rows
from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

# Marked per test: the report comes from the benchmark run on gloo ranks (multirank); the
# argument parsing and model sizing run in-process (unit).


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    run_on_ranks(scenarios.small_benchmark, 2, str(path))
    return json.loads(path.read_text())


@pytest.mark.multirank
def test_json_has_the_documented_shape(report):
    assert report["world_size"] == 2
    assert report["muon_elements"] == 2 * (4 * 64 * 64 + 3 * 64 * ffn_hidden(64))
    assert set(report["results"]) == set(OPTIMIZERS)
    for row in report["results"].values():
        assert row["step_ms"] > 0
        assert isinstance(row["bytes_sent_per_rank"], int)


@pytest.mark.multirank
def test_dmuon_sends_exactly_the_owner_computed_minimum(report):
    n, p = report["muon_elements"], report["world_size"]
    assert report["results"]["dmuon"]["bytes_sent_per_rank"] == 4 * n * (p - 1) // p**2


@pytest.mark.multirank
def test_one_matrix_per_batch_still_sends_exactly_the_minimum(tmp_path):
    path = tmp_path / "bench.json"
    run_on_ranks(scenarios.small_batches_benchmark, 2, str(path))
    report = json.loads(path.read_text())
    n, p = report["muon_elements"], report["world_size"]
    dmuon = report["results"]["dmuon"]
    assert dmuon["batches"] == 7  # 14 matrices, one per rank per batch
    assert dmuon["bytes_sent_per_rank"] == 4 * n * (p - 1) // p**2


@pytest.mark.multirank
def test_newton_schulz_work_is_split_evenly_between_the_ranks(report):
    from dmuon.numerics.newton_schulz import newton_schulz_flops

    hidden = ffn_hidden(64)
    total = 2 * (4 * newton_schulz_flops((64, 64)) + 3 * newton_schulz_flops((hidden, 64)))
    assert report["results"]["dmuon"]["ns_flops_per_rank_max"] <= 1.1 * total / 2


@pytest.mark.multirank
def test_each_row_says_which_dtype_its_newton_schulz_ran_in(report):
    dtypes = {name: row["ns_dtype"] for name, row in report["results"].items()}
    assert dtypes == {"dmuon": "float32", "dmuon_bf16": "bfloat16", "redistribute": "float32",
                      "vanilla": "bfloat16", "adamw": None, "single": "float32"}


@pytest.mark.multirank
def test_vanilla_is_compared_with_dmuon_in_bf16_only(report):
    results = report["results"]
    assert report["speedup_vs_vanilla"] == results["vanilla"]["step_ms"] / results["dmuon_bf16"]["step_ms"]
    rows = {line.split()[0]: line.split() for line in format_table(report).splitlines()[2:8]}
    assert rows["dmuon"][1:2] == ["float32"] and rows["dmuon"][3] == "-"
    assert rows["dmuon_bf16"][1:2] == ["bfloat16"] and rows["dmuon_bf16"][3].endswith("x")


@pytest.mark.multirank
def test_dmuon_in_bf16_sends_the_same_bytes_as_dmuon(report):
    assert report["results"]["dmuon_bf16"]["bytes_sent_per_rank"] == report["results"]["dmuon"]["bytes_sent_per_rank"]


@pytest.mark.multirank
def test_newton_schulz_throughput_is_reported_for_both_dtypes(report):
    rates = report["ns_throughput_gflops"]
    assert set(rates) == {"bfloat16", "float32"} and all(rate > 0 for rate in rates.values())
    assert "Newton-Schulz on one 64 x 64 matrix" in format_table(report)


@pytest.mark.multirank
def test_the_bf16_row_is_skipped_when_dmuon_already_runs_in_bf16(tmp_path):
    path = tmp_path / "bench.json"
    run_on_ranks(scenarios.bf16_benchmark, 1, str(path))
    assert set(json.loads(path.read_text())["results"]) == {"dmuon"}


@pytest.mark.multirank
def test_vanilla_muon_sends_more_than_dmuon(report):
    assert report["results"]["vanilla"]["bytes_sent_per_rank"] > report["results"]["dmuon"]["bytes_sent_per_rank"]


@pytest.mark.multirank
def test_adamw_sends_nothing_in_its_step(report):
    assert report["results"]["adamw"]["bytes_sent_per_rank"] == 0


@pytest.mark.multirank
def test_table_shows_every_optimizer_and_the_efficiency(report):
    table = format_table(report)
    assert all(name in table for name in OPTIMIZERS)
    assert "parallel efficiency" in table


@pytest.mark.unit
def test_llama_ffn_hidden_size_is_rounded_up():
    assert ffn_hidden(512) == 1536


@pytest.mark.unit
def test_unknown_optimizer_name_is_rejected():
    with pytest.raises(SystemExit):
        parse_args(["--optimizers", "dmuon,sgd"])


@pytest.fixture
def cpu_without_bf16_matmul(monkeypatch):
    """A CPU like an AVX2 one: no native bf16 GEMM (accelerators keep theirs)."""
    monkeypatch.setattr(bench_workload, "native_bf16_matmul", lambda device_type: device_type != "cpu")


@pytest.mark.unit
def test_the_bf16_rows_are_left_out_by_default_on_a_cpu_without_bf16_matmul(cpu_without_bf16_matmul):
    assert slow_bf16_rows(OPTIMIZERS, "cpu", asked=False) == BF16_ROWS == ("dmuon_bf16", "vanilla")


@pytest.mark.unit
def test_the_bf16_rows_run_when_asked_or_where_bf16_matmul_is_native(cpu_without_bf16_matmul):
    assert slow_bf16_rows(OPTIMIZERS, "cpu", asked=True) == ()
    assert slow_bf16_rows(OPTIMIZERS, "cuda", asked=False) == ()


@pytest.mark.unit
def test_the_bf16_rows_run_on_a_cpu_with_native_bf16_matmul(monkeypatch):
    monkeypatch.setattr(bench_workload, "native_bf16_matmul", lambda device_type: True)
    assert slow_bf16_rows(OPTIMIZERS, "cpu", asked=False) == ()


@pytest.mark.unit
@pytest.mark.parametrize("argv, asked", [([], False), (["--bf16-rows"], True), (["--optimizers", "dmuon,vanilla"], True),
                                         (["--optimizers", "dmuon,adamw"], False)])
def test_one_flag_or_naming_a_bf16_row_asks_for_the_bf16_rows(argv, asked):
    assert parse_args(argv).bf16_rows is asked


@pytest.mark.unit
def test_the_table_says_which_rows_were_left_out_and_why():
    report = {"world_size": 1, "device": "cpu", "threads_per_rank": 1, "muon_elements": 1, "layout": "fsdp",
              "mesh_shape": [1], "results": {}, "min_bytes_per_rank": 0, "ns_algorithm": "gram",
              "left_out": {"vanilla": bench_workload.SLOW_BF16_REASON}}
    table = format_table(report)
    assert "vanilla" in table and "--bf16-rows" in table and "ns_algorithm gram" in table


@pytest.mark.unit
@pytest.mark.parametrize("row", ["dmuon", "dmuon_bf16", "redistribute"])
def test_the_ns_algorithm_reaches_the_dmuon_rows(row):
    import torch

    cfg = parse_args(["--ns-algorithm", "auto"])
    optimizer = bench._make_optimizer(row, [torch.nn.Parameter(torch.zeros(4, 8))], cfg)
    assert optimizer.param_groups[0]["ns_algorithm"] == "auto"
