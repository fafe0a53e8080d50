"""A small llama3 parallelized by TorchTitan's own ``parallelize_llama``: DMuon takes
the owner exchange for every hidden weight and matches single-process DMuon bit for bit.

FSDP 2 x TP 2 gives the real ``_StridedShard`` (colwise weights) and ``(Shard(0),
Shard(1))`` (rowwise weights); HSDP gives ``(Replicate(), Shard(0))``; TP alone gives
``Shard(0)`` and ``Shard(1)`` on the TP mesh.
"""

from __future__ import annotations

import pytest

from tests import mesh_scenarios as scenarios
from tests.distributed_scenarios import NS_DTYPES
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

# (dp_replicate, dp_shard, tp) and the world size.
SETUPS = {
    "fsdp2_tp2": ((1, 2, 2), 4),
    "hsdp2x2": ((2, 2, 1), 4),
    "tp2": ((1, 1, 2), 2),
}
# The 2-D hidden weights of the one-layer llama3 (the scenario puts them on Muon).
HIDDEN_WEIGHTS = {f"layers.0.{m}.weight" for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                   "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """Each setup on ranks of its own: TorchTitan keeps its meshes in process-wide state."""
    return {name: run_on_ranks(scenarios.titan_llama3_exactness, world, *degrees, fresh=True)
            for name, (degrees, world) in SETUPS.items()}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("ns_dtype", NS_DTYPES)
def test_every_hidden_weight_is_bitwise_equal_to_single_process(runs, ns_dtype, setup):
    equal = [rank["equal"][ns_dtype] for rank in runs[setup]]
    world = SETUPS[setup][1]
    assert equal == [dict.fromkeys(HIDDEN_WEIGHTS, True)] * world


@pytest.mark.parametrize("setup", list(SETUPS))
def test_every_hidden_weight_takes_the_owner_exchange(runs, setup):
    assert set(runs[setup][0]["paths"].values()) == {"all_to_all"}, runs[setup][0]["paths"]


def test_fsdp_over_tp_really_uses_strided_shards(runs):
    placements = runs["fsdp2_tp2"][0]["placements"]
    assert "_StridedShard(dim=0, sf=2)" in placements["layers.0.attention.wq.weight"]
    assert placements["layers.0.attention.wo.weight"] == "(Shard(dim=0), Shard(dim=1))"
