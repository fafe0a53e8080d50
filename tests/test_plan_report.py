"""python -m dmuon.tools.plan_report: the optimizer's own planner at P up to 1024, from shapes alone."""

from __future__ import annotations

import json

import pytest

from dmuon.numerics.newton_schulz import newton_schulz_flops
from dmuon.tools.plan_report import PRESETS, main, min_bytes_per_rank

pytestmark = pytest.mark.unit

KEYS = {
    "model", "world_size", "matrices", "muon_elements", "ns_flops_total", "ns_flops_per_rank_max",
    "ns_critical_path_flops", "ns_efficiency", "lpt_bound_efficiency", "batches", "bytes_sent_per_rank_max",
    "bytes_minimum", "peak_scratch_bytes_per_rank", "predicted",
}
PREDICTED_KEYS = {"ns_ms", "comm_ms", "optimizer_ms", "train_step_ms", "optimizer_fraction"}


def _report(capsys, *args: str) -> dict | list:
    main([*args, "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model, world_size", [
    ("llama3-8b", 8), ("llama3-8b", 64), ("llama3-70b", 64), ("llama3-70b", 256), ("llama3-405b", 512),
])
def test_the_plan_keeps_every_rank_busy_and_sends_near_the_minimum(capsys, model, world_size):
    row = _report(capsys, "--model", model, "--world-size", str(world_size))
    assert row["ns_efficiency"] >= 0.9 * row["lpt_bound_efficiency"]
    assert row["ns_flops_total"] == sum(newton_schulz_flops(s) for s in PRESETS[model].matrices())
    assert row["bytes_sent_per_rank_max"] <= 1.25 * row["bytes_minimum"]
    assert row["bytes_minimum"] == 4 * row["muon_elements"] * (world_size - 1) // world_size**2


def test_json_has_exactly_the_documented_keys(capsys):
    row = _report(capsys, "--model", "llama3-8b", "--world-size", "64")
    assert set(row) == KEYS and set(row["predicted"]) == PREDICTED_KEYS
    assert row["model"] == "llama3-8b" and row["matrices"] == 224 and row["muon_elements"] == 6979321856


def test_several_rows_print_a_json_list(capsys):
    rows = _report(capsys, "--model", "llama3-8b", "llama3-70b", "--world-size", "8", "64")
    assert [(r["model"], r["world_size"]) for r in rows] == [
        ("llama3-8b", 8), ("llama3-8b", 64), ("llama3-70b", 8), ("llama3-70b", 64)]


def test_the_readable_table_names_what_limits_each_row(capsys):
    main(["--model", "llama3-8b", "--world-size", "8", "1024"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["model", "P"]
    assert "granularity: 224 matrices on 1024 ranks" in lines[2]


def test_train_step_follows_six_params_tokens_over_mfu_peak(capsys):
    row = _report(capsys, "--model", "llama3-8b", "--world-size", "8", "--peak-tflops", "1000",
                  "--train-mfu", "0.5", "--tokens-per-rank", "1000")
    expected_ms = 6 * PRESETS["llama3-8b"].params() * 1000 / (0.5 * 1000e12) * 1e3
    assert row["predicted"]["train_step_ms"] == pytest.approx(expected_ms)
    assert 8.0e9 < PRESETS["llama3-8b"].params() < 8.1e9


def test_more_bandwidth_never_slows_the_predicted_step(capsys):
    slow = _report(capsys, "--model", "llama3-70b", "--world-size", "64", "--link-gbps", "100")
    fast = _report(capsys, "--model", "llama3-70b", "--world-size", "64", "--link-gbps", "1600")
    assert fast["predicted"]["optimizer_ms"] <= slow["predicted"]["optimizer_ms"]
    assert fast["predicted"]["ns_ms"] == slow["predicted"]["ns_ms"]


def test_a_shapes_file_takes_plain_shapes_and_block_layouts(capsys, tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"params": 1000, "shapes": [[64, 32], [32, 64], {"shape": [4, 16, 16], "shard_dim": 1}]}))
    row = _report(capsys, "--shapes", str(path), "--world-size", "4")
    assert row["model"] == "mine" and row["matrices"] == 2 + 4
    assert row["ns_flops_total"] == 2 * newton_schulz_flops((64, 32)) + 4 * newton_schulz_flops((16, 16))


def test_one_rank_moves_nothing(capsys):
    row = _report(capsys, "--model", "llama3-8b", "--world-size", "1")
    assert row["bytes_sent_per_rank_max"] == row["bytes_minimum"] == 0
    assert row["ns_efficiency"] == pytest.approx(1.0)


def test_replicas_print_a_split_and_an_apart_row_each_against_its_own_minimum(capsys):
    split, apart = _report(capsys, "--model", "llama3-8b", "--world-size", "64", "--replicas", "4")
    assert (split["replicas"], split["split_replicas"], apart["split_replicas"]) == (4, True, False)
    n = split["muon_elements"]
    assert split["bytes_minimum"] == int(2 * n * (16 + 64 - 2) / (16 * 64))
    assert apart["bytes_minimum"] == int(4 * n * 15 / 16**2)
    for row in (split, apart):
        assert row["bytes_sent_per_rank_max"] <= 1.25 * row["bytes_minimum"]


def test_splitting_across_replicas_runs_newton_schulz_like_fsdp_over_every_rank(capsys):
    fsdp, split, apart = _report(capsys, "--model", "llama3-8b", "--world-size", "64", "--replicas", "1", "4")
    assert split["ns_flops_per_rank_max"] == fsdp["ns_flops_per_rank_max"]
    assert apart["ns_flops_per_rank_max"] > 3 * split["ns_flops_per_rank_max"]  # R = 4 replicas each do all


def test_replicas_must_divide_the_world_size(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "llama3-8b", "--world-size", "64", "--replicas", "3"])
    assert "--replicas must divide" in capsys.readouterr().err


def test_ns_dtype_float32_predicts_slower_newton_schulz(capsys):
    times = {}
    for dtype in ("bfloat16", "float32"):
        main(["--model", "llama3-8b", "--world-size", "8", "--json", "--ns-dtype", dtype])
        times[dtype] = json.loads(capsys.readouterr().out)["predicted"]["ns_ms"]
    assert times["float32"] > 10 * times["bfloat16"]


def test_minimum_bytes_for_fsdp_is_an_owner_round_trip():
    assert min_bytes_per_rank("fsdp", (4,), 1600, True) == 4 * 1600 * 3 // 16


def test_hsdp_minimum_bytes_split_and_apart_agree_at_two_shards():
    assert min_bytes_per_rank("hsdp", (2, 2), 1600, True) == min_bytes_per_rank("hsdp", (2, 2), 1600, False) == 1600


def _llama3_8b_row(capsys, algorithm: str) -> dict:
    main(["--model", "llama3-8b", "--world-size", "8", "--json", "--ns-algorithm", algorithm])
    return json.loads(capsys.readouterr().out)


def test_auto_ns_algorithm_cuts_llama3_8b_flops_by_the_gram_formula(capsys):
    """Per 5 iterations in m^3 (aspect a): standard 20a + 10, Gram 8a + 28; auto takes the smaller."""
    standard, auto = _llama3_8b_row(capsys, "standard"), _llama3_8b_row(capsys, "auto")

    def cubes(shape, gram):
        m, n = sorted(shape)
        a = n / m
        return (min(20 * a + 10, 8 * a + 28) if gram else 20 * a + 10) * m**3

    matrices = PRESETS["llama3-8b"].matrices()
    ratio = sum(cubes(s, True) for s in matrices) / sum(cubes(s, False) for s in matrices)
    assert auto["ns_flops_total"] == pytest.approx(ratio * standard["ns_flops_total"], rel=1e-12)
    assert ratio < 0.85

