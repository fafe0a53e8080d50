"""benchmarks.vs_distmuon: the model of TorchTitan DistMuon's owner choice, the byte
counts, and a few figures of docs/vs_distmuon.md pinned (llama3 8B at P = 8, the
cheapest row; the whole table takes ~20 s).

The model of DistMuon's balancing is also checked against TorchTitan's own function
where TorchTitan 0.3.x is installed (skipped beside 0.2.x, this project's default; the
0.3 leg of scripts/test_newest_torch.sh runs this file).
"""

from __future__ import annotations

import pytest

from benchmarks.distmuon_model import (
    bucket_pipeline_flops,
    buckets_for,
    distmuon_cost,
    distmuon_owners,
    whole_matrix_exchange_bytes,
)
from benchmarks.vs_distmuon import PRESETS, compare, fsdp_step_bytes, muon_matrices, step_bytes
from dmuon.numerics.newton_schulz import newton_schulz_flops
from dmuon.tools.plan_report import min_bytes_per_rank

pytestmark = pytest.mark.unit


def test_distmuon_balances_each_bucket_first_and_the_step_only_to_break_ties():
    # Layer 0: one 8x8 matrix; layer 1: two 4x8 ones. Per-layer buckets: the 8x8 goes to
    # rank 0; in layer 1's bucket the second 4x8 goes to rank 0 again, whose bucket load
    # is 0, although its step load is far larger. One bucket is a plain LPT.
    matrices = [("layers.0.big.weight", (8, 8)), ("layers.1.a.weight", (4, 8)), ("layers.1.b.weight", (4, 8))]
    assert distmuon_owners(matrices, 2, "per_layer") == [0, 1, 0]
    assert distmuon_owners(matrices, 2, "one_bucket") == [0, 1, 1]


def test_distmuon_cost_is_half_of_dmuons_flops():
    for shape in [(4096, 14336), (14336, 4096), (1024, 4096), (7, 7)]:
        assert 2 * distmuon_cost(shape) == newton_schulz_flops(shape)


def test_whole_matrix_exchange_counts_each_block_once_each_way_and_nothing_for_the_owner():
    # Rows chunked as torch's Shard(0): 5 rows on 2 ranks are 3 + 2; owner 0.
    sent, received = whole_matrix_exchange_bytes([(5, 3)], [0], 2, element_size=4)
    assert sent == received == [2 * 3 * 4, 2 * 3 * 4]
    # Owner 1 gets rank 0's 3 rows.
    assert whole_matrix_exchange_bytes([(5, 3)], [1], 2, element_size=4) == ([36, 36], [36, 36])


def test_the_bucket_pipeline_lets_a_bucket_start_once_every_rank_finished_the_one_before_the_last():
    shapes = [(2, 2)] * 3
    unit = newton_schulz_flops((2, 2))
    buckets = [[0], [1], [2]]
    # Everything on rank 0: one after another. Round robin over 3 ranks: bucket 2 waits
    # for bucket 0 to finish on every rank, so two run at once, not three.
    assert bucket_pipeline_flops(shapes, [0, 0, 0], 3, buckets) == 3 * unit
    assert bucket_pipeline_flops(shapes, [0, 1, 2], 3, buckets) == 2 * unit


def test_per_layer_buckets_hold_each_transformer_block():
    names = [name for name, _ in muon_matrices(PRESETS["llama3-8b"])]
    buckets = buckets_for(names, "per_layer")
    assert len(buckets) == 32 and all(len(b) == 7 for b in buckets)
    assert {names[i].split(".")[1] for i in buckets[10]} == {"10"}


@pytest.fixture(scope="module")
def llama3_8b_at_8():
    return compare("llama3-8b", 8)


def test_pinned_llama3_8b_at_8_ranks_exchange(llama3_8b_at_8):
    row = llama3_8b_at_8
    assert row["muon_elements"] == 6_979_321_856
    # DMuon sends and receives exactly the owner-exchange minimum.
    assert row["dmuon"]["bytes_per_rank_max"] == 2 * min_bytes_per_rank("fsdp", (8,), row["muon_elements"], True)
    assert row["dmuon"]["bytes_per_rank_max"] == 6_106_906_624
    # DistMuon, fp32: one bucket is twice that; a bucket per block a little more.
    assert row["distmuon_one_bucket"]["bytes_per_rank_max"] == 2 * 6_106_906_624
    assert row["distmuon_per_layer"]["bytes_per_rank_max"] == 12_415_139_840
    assert row["distmuon_per_layer"]["ns_max_over_mean"] == pytest.approx(1.0236, abs=1e-4)
    assert row["distmuon_per_layer"]["ns_critical_over_mean"] == pytest.approx(1.0908, abs=1e-4)
    assert row["dmuon"]["ns_max_over_mean"] == row["dmuon"]["ns_critical_over_mean"] == 1.0


def test_pinned_llama3_8b_at_8_ranks_training_step(llama3_8b_at_8):
    row = step_bytes("llama3-8b", 8, llama3_8b_at_8["plan"])
    assert row["all_gather_forward"] == 28_105_914_368
    assert row["all_gather_backward"] == 26_267_222_016  # norm and output stay gathered
    assert row["reduce_scatter"] == 2 * row["all_gather_forward"]  # fp32 against bf16
    assert row["dmuon_exchange"] == 6_106_906_624
    assert row["ratio"] == pytest.approx(1.0552, abs=1e-4)
    assert row["allgather_muon_ratio"] == pytest.approx(1.2209, abs=1e-4)


def test_fsdp_bytes_pad_dim0_to_a_multiple_of_the_ranks():
    model = PRESETS["llama3-8b"]
    # At P = 8 every dim 0 divides: exactly 2 (P-1)/P of the parameters, 4 bytes each.
    assert fsdp_step_bytes(model, 8)["reduce_scatter"] == 2 * 7 * model.params() * 4 // 8
    # 128256 vocabulary rows on 1024 ranks: 126-row shards, so a little more than that.
    padded = fsdp_step_bytes(model, 1024)["reduce_scatter"]
    assert 2 * 1023 * model.params() * 4 / 1024 < padded < 1.001 * 2 * 1023 * model.params() * 4 / 1024


def test_the_model_matches_torchtitans_own_balancing_function():
    """Where TorchTitan 0.3.x is installed: its _balance_loads_across_partitions, driven
    bucket by bucket, picks the owners distmuon_owners picks."""
    dist_muon = pytest.importorskip("torchtitan.distributed.flex_shard.dist_muon")
    import torch

    matrices = muon_matrices(PRESETS["llama3-8b"])
    for world_size in (8, 64):
        for bucketing in ("per_layer", "one_bucket"):
            owners = [0] * len(matrices)
            cumulative = (0,) * world_size
            for bucket in buckets_for([n for n, _ in matrices], bucketing):
                items = sorted(bucket, key=lambda i: matrices[i][0])
                loads = tuple((dist_muon._estimate_muon_compute_cost(torch.Size(matrices[i][1]), 5),
                               matrices[i][1][0] * matrices[i][1][1] * 4, matrices[i][0]) for i in items)
                parts, cumulative = dist_muon._balance_loads_across_partitions(
                    loads, initial_cumulative_primary_loads=cumulative)
                for i, part in zip(items, parts):
                    owners[i] = part
            assert distmuon_owners(matrices, world_size, bucketing) == owners


def test_dmuon_with_gram_cuts_llama3_8b_newton_schulz_by_the_flops_formula(llama3_8b_at_8):
    """ns_algorithm="auto": wk/wv (aspect 4) and w1/w2/w3 (3.5) run Gram, wq/wo stay standard;
    per 5 iterations in m^3, standard 20a + 10 and Gram 8a + 28, balanced on 8 ranks."""
    d, f, kv = 4096, 14336, 1024
    standard = 2 * 30 * d**3 + 2 * 90 * kv**3 + 3 * 80 * d**3
    gram = 2 * 30 * d**3 + 2 * 60 * kv**3 + 3 * 56 * d**3
    assert f == 3.5 * d
    row = llama3_8b_at_8["dmuon_gram"]
    assert row["ns_critical_over_mean"] == pytest.approx(gram / standard, abs=1e-3)
    assert row["bytes_per_rank_max"] == llama3_8b_at_8["dmuon"]["bytes_per_rank_max"]
