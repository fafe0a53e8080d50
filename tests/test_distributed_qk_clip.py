"""QK-clip on P gloo ranks equals QK-clip in one process, bit for bit: the MAX over
every rank's logits, and the row scaling of each rank's block of ``W_q`` / ``W_k``
under FSDP (P = 1, 2, 4), HSDP (2 x 2) and FSDP + TP (2 x 2), for a multi-head and a
grouped-query attention (``tests/qk_clip_scenarios.py``)."""

from __future__ import annotations

import pytest

from tests import qk_clip_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

# (world size, layout) pairs the scenario runs.
RUNS = [(1, "fsdp"), (2, "fsdp"), (4, "fsdp"), (4, "hsdp"), (4, "fsdp_tp")]


@pytest.fixture(scope="module")
def checks() -> dict[tuple[int, str], dict[str, bool]]:
    out = {}
    for world in sorted({w for w, _ in RUNS}):
        for layout, result in run_on_ranks(scenarios.layouts_match_single_process, world)[0].items():
            out[(world, layout)] = result
    return out


@pytest.mark.parametrize("world,layout", RUNS)
def test_clipped_weights_are_bitwise_equal_to_single_process(checks, world, layout):
    result = checks[(world, layout)]
    assert {k: v for k, v in result.items() if k.startswith("weights.")} == {
        f"weights.{name}.{w}": True for name in scenarios.ATTENTIONS for w in ("wq", "wk")}


@pytest.mark.parametrize("world,layout", RUNS)
def test_every_rank_sees_the_global_max_logit_of_each_head(checks, world, layout):
    result = checks[(world, layout)]
    assert {k: v for k, v in result.items() if k.startswith("max_logits.")} == {
        f"max_logits.{name}": True for name in scenarios.ATTENTIONS}


@pytest.mark.parametrize("world,layout", RUNS)
def test_telemetry_counts_the_clipped_heads_as_one_process_does(checks, world, layout):
    assert checks[(world, layout)]["clipped_heads"]
    assert checks[(world, layout)]["some_heads_clipped_every_step"]
