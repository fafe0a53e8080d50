"""Missing, disagreeing, invalid and non-finite grads on 2 gloo ranks: clear outcomes, no hang.

Every launch has a timeout (tests/multiprocess.py), so a hang fails the test.
"""

from __future__ import annotations

import pytest

from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(scenarios.robustness, 2, timeout=120)


def test_grad_none_on_every_rank_skips_the_parameter(ranks):
    for rank in ranks:
        assert rank["none_everywhere_unchanged"]
        assert rank["none_everywhere_no_state"]
        assert rank["none_everywhere_others_stepped"]


def test_a_grad_on_some_ranks_only_masks_the_whole_step_on_every_rank(ranks):
    for rank in ranks:
        assert rank["disagree_step"] is None
        assert rank["disagree_unchanged"]


def test_ranks_disagreeing_about_a_grad_all_raise_an_error_naming_it_at_the_next_step_and_nothing_changed(ranks):
    for rank in ranks:
        assert rank["disagree_error"].startswith("RuntimeError: DMuon: ranks disagree")
        assert "'uneven'" in rank["disagree_error"]
        assert rank["disagree_error_unchanged"]


def test_an_invalid_grad_on_one_rank_raises_there_at_once_and_moves_no_parameter(ranks):
    assert ranks[1]["invalid_step"] == "ValueError: DMuon: parameter 'square': complex gradients are not supported by Muon"
    assert ranks[0]["invalid_step"] is None
    assert [rank["invalid_unchanged"] for rank in ranks] == [True, True]


def test_an_invalid_grad_on_one_rank_makes_every_rank_raise_at_the_next_step(ranks):
    for rank in ranks:
        assert rank["invalid_error"].startswith("ValueError: DMuon: 1 rank(s) found an invalid gradient or shard")


def test_after_the_next_step_raised_every_parameter_and_state_is_as_before_the_invalid_grad(ranks):
    assert [rank["invalid_all_unchanged"] for rank in ranks] == [True, True]


def test_a_sparse_grad_on_one_rank_raises_there_then_everywhere_and_changes_no_muon_parameter():
    ranks = run_on_ranks(scenarios.sparse_grad_on_one_rank, 2, timeout=120)
    assert ranks[0]["step"] == "ValueError: DMuon: parameter 'emb': sparse gradients are not supported"
    assert ranks[1]["step"] is None
    for rank in ranks:
        assert rank["unchanged"]
        assert rank["next"].startswith("ValueError: DMuon: 1 rank(s) found an invalid gradient")
        assert rank["after"] is None


def test_the_optimizer_keeps_working_after_a_consistent_error(ranks):
    assert [rank["usable_after_errors"] for rank in ranks] == [True, True]


def test_a_nan_in_one_shard_poisons_only_its_matrix_on_every_rank(ranks):
    for rank in ranks:
        assert rank["nan_error"] is None
        assert rank["nan_matrix_all_nan"]
        assert rank["nan_others_finite"]


def test_zero_grad_lr0_step_leaves_params_unchanged(ranks):
    assert [rank["lr0_unchanged"] for rank in ranks] == [True, True]


def test_zero_grad_lr0_step_creates_the_same_full_state_on_every_rank(ranks):
    keys = ranks[0]["lr0_state_keys"]
    assert keys == ranks[1]["lr0_state_keys"]
    assert keys["square"] == ["momentum_buffer"]
    assert keys["norm.weight"] == ["exp_avg", "exp_avg_sq", "step"]
    assert [rank["lr0_state_finite"] for rank in ranks] == [True, True]


def test_state_tensors_are_dtensors_with_the_parameter_placement(ranks):
    placements = ranks[0]["lr0_state_placements"]
    assert placements["empty_shard"] == ["(Shard(dim=0),)"]
    assert placements["tok_embeddings.weight"] == ["(Shard(dim=0),)", "(Shard(dim=0),)"]


def test_shards_that_are_not_torch_chunk_splits_make_every_rank_raise():
    errors = run_on_ranks(scenarios.custom_uneven_shards, 2, timeout=120)
    assert all(e and "are not the blocks their placements describe" in e for e in errors), errors
    assert "'odd'" in errors[0]


def test_every_rank_runs_the_same_collectives_whatever_its_grads():
    """Op, dtype and size of every backend collective: the same on every rank in each step
    (an all-to-all's own split aside), and in each step that does not raise at its start
    the same as a clean step's, though the grads go wrong on some ranks only."""
    ranks = run_on_ranks(scenarios.collective_sequences, 4, timeout=120)
    steps = scenarios.SEQUENCE_STEPS
    assert any(name == "gloo:all_to_all" for name, _, _ in ranks[0]["steps"][0]), ranks[0]["steps"][0]
    for index, what in enumerate(steps):
        seen = [scenarios.across_ranks(rank["steps"][index]) for rank in ranks]
        assert all(s == seen[0] for s in seen), (what, seen)
        if what in scenarios.SEQUENCE_LIKE_CLEAN:
            for r, rank in enumerate(ranks):
                assert rank["steps"][index] == rank["twin"][index], (what, r, rank["steps"][index], rank["twin"][index])


def test_comm_paths_on_one_rank_runs_no_collective():
    ranks = run_on_ranks(scenarios.comm_paths_on_one_rank, 2, timeout=60)
    assert set(ranks[0].values()) == {"all_to_all"}


def test_an_invalid_grad_never_leaves_a_rank_waiting_in_another_mesh():
    errors = run_on_ranks(scenarios.invalid_grad_with_two_meshes, 4, timeout=60)
    assert errors[3][0] == "ValueError: DMuon: parameter 'a': complex gradients are not supported by Muon"
    assert [first for first, _ in errors[:3]] == [None, None, None]
    assert all(then.startswith("ValueError: DMuon: 1 rank(s) found an invalid gradient") for _, then in errors), errors
