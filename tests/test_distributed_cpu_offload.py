"""FSDP2's CPU offload: the staged step (host tensors, exchange on the device, through host
buffers: ``dmuon.exchange.host_staging``) is bitwise the direct one, on 2 gloo ranks.

Without a GPU the staging is forced on a CPU mesh (``host_staging.FORCE``): the same code
as on a GPU, with host buffers on both sides. Each run also reports the waits the
staged step announced in its last step, which docs/dry_run.md ("CPU offload") documents.
"""

from __future__ import annotations

import pytest

from dmuon.exchange.host_staging import KEPT, MASKS, NORMUON_ROWS, QK_CLIP_FACTORS, RESULTS
from tests import offload_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def plain() -> list[dict]:
    return run_on_ranks(scenarios.fast_path, 2, timeout=180)


@pytest.fixture(scope="module")
def normuon() -> list[dict]:
    return run_on_ranks(scenarios.fast_path, 2, {"normuon": True, "cautious_weight_decay": True}, timeout=180)


@pytest.fixture(scope="module")
def int8_momentum() -> list[dict]:
    return run_on_ranks(scenarios.fast_path, 2, {"momentum_dtype": "int8"}, timeout=180)


def test_staged_int8_momentum_and_its_scales_are_bitwise_the_direct_ones(int8_momentum):
    for rank in int8_momentum:
        assert rank["equal"] == dict.fromkeys(rank["equal"], True)
        assert any(name.endswith("momentum_scales") for name in rank["names"])


def test_staged_parameters_and_state_are_bitwise_the_direct_ones(plain):
    for rank in plain:
        assert rank["equal"] == dict.fromkeys(rank["equal"], True)
        assert any(name.endswith("momentum_buffer") for name in rank["names"])


def test_staged_normuon_rows_and_cautious_decay_are_bitwise_the_direct_ones(normuon):
    for rank in normuon:
        assert rank["equal"] == dict.fromkeys(rank["equal"], True)
        assert any(name.endswith("normuon_second_moment") for name in rank["names"])


def test_a_staged_step_waits_once_for_the_masks_and_once_per_batch_received(plain):
    for rank in plain:
        assert rank["waits"][MASKS] == 1
        assert rank["waits"][RESULTS] == rank["batches_received"]


def test_each_unit_kept_whole_waits_once_for_its_result_on_its_holder(plain):
    assert [rank["waits"].get(KEPT, 0) for rank in plain] == [rank["kept"] for rank in plain]
    assert plain[0]["kept"] > plain[1]["kept"] > 0  # the one-row matrix is rank 0's; the experts, both's


def test_a_staged_normuon_step_waits_once_more_for_its_rows(normuon):
    for rank in normuon:
        assert rank["waits"][NORMUON_ROWS] == 1


def test_staged_qk_clip_scales_rows_bitwise_as_the_direct_one_after_one_wait_for_its_factors():
    for rank in run_on_ranks(scenarios.qk_clip, 2, timeout=180):
        assert rank["equal"] == dict.fromkeys(rank["equal"], True)
        assert rank["waits"][QK_CLIP_FACTORS] == 1
