"""QK-clip on P gloo ranks equals QK-clip in one process, bit for bit: the MAX over
every rank's logits, and the row scaling of each rank's block of ``W_q`` / ``W_k``
under FSDP (P = 1, 2, 4), HSDP (2 x 2) and FSDP + TP (2 x 2), for a multi-head and a
grouped-query attention (``tests/qk_clip_scenarios.py``). Every rank reports its own
checks and every rank is judged."""

from __future__ import annotations

import pytest

from tests import qk_clip_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank

# (world size, layout) pairs the scenario runs.
RUNS = [(1, "fsdp"), (2, "fsdp"), (4, "fsdp"), (4, "hsdp"), (4, "fsdp_tp")]


@pytest.fixture(scope="module")
def checks() -> dict[tuple[int, str], list[dict[str, bool]]]:
    """Per (world size, layout): every rank's checks, rank 0's first."""
    out: dict[tuple[int, str], list[dict[str, bool]]] = {}
    for world in sorted({w for w, _ in RUNS}):
        for rank in run_on_ranks(scenarios.layouts_match_single_process, world):
            for layout, result in rank.items():
                out.setdefault((world, layout), []).append(result)
    return out


def _starting(prefix: str, ranks: list[dict[str, bool]]) -> list[dict[str, bool]]:
    return [{k: v for k, v in rank.items() if k.startswith(prefix)} for rank in ranks]


@pytest.mark.parametrize("world,layout", RUNS)
def test_clipped_weights_are_bitwise_equal_to_single_process(checks, world, layout):
    expected = {f"weights.{name}.{w}": True for name in scenarios.ATTENTIONS for w in ("wq", "wk")}
    assert _starting("weights.", checks[(world, layout)]) == [expected] * world


@pytest.mark.parametrize("world,layout", RUNS)
def test_every_rank_sees_the_global_max_logit_of_each_head(checks, world, layout):
    expected = {f"max_logits.{name}": True for name in scenarios.ATTENTIONS}
    assert _starting("max_logits.", checks[(world, layout)]) == [expected] * world


@pytest.mark.parametrize("world,layout", RUNS)
def test_telemetry_counts_the_clipped_heads_as_one_process_does(checks, world, layout):
    assert [rank["clipped_heads"] for rank in checks[(world, layout)]] == [True] * world
    assert [rank["some_heads_clipped_every_step"] for rank in checks[(world, layout)]] == [True] * world
