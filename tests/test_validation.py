"""Bad input raises ValueError/TypeError, and the message names the parameter or option."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon import DMuon

pytestmark = pytest.mark.unit


def _matrix(rows: int = 4, cols: int = 4) -> nn.Parameter:
    return nn.Parameter(torch.randn(rows, cols))


# ------------------------------------------------------------------ parameters


def test_1d_parameter_forced_into_muon_names_it_and_suggests_adamw():
    bias = nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"'layer\.bias'.*ndim >= 2.*use_muon=False"):
        DMuon([{"params": [("layer.bias", bias)], "use_muon": True}])


def test_unnamed_1d_parameter_forced_into_muon_is_named_by_position():
    with pytest.raises(ValueError, match=r"'param_groups\[0\]\[1\]'.*use_muon=False"):
        DMuon([{"params": [_matrix(), nn.Parameter(torch.zeros(4))], "use_muon": True}])


def test_complex_parameter_in_muon_is_rejected():
    weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"'w'.*complex.*use_muon=False"):
        DMuon([{"params": [("w", weight)], "use_muon": True}])


def test_complex_parameter_in_adamw_is_accepted_and_stepped_like_torch_adamw():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4, 4, dtype=torch.complex64, generator=generator)
    grad = torch.randn(4, 4, dtype=torch.complex64, generator=generator)
    weight, reference = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    optimizer = DMuon([{"params": [weight], "use_muon": False}], lr=0.1, weight_decay=0.01)
    expected = torch.optim.AdamW([reference], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    weight.grad, reference.grad = grad.clone(), grad.clone()
    optimizer.step()
    expected.step()
    assert not torch.equal(weight, start)  # it was updated ...
    torch.testing.assert_close(weight, reference, rtol=0, atol=0)  # ... exactly as AdamW would


def test_integer_tensor_in_muon_is_rejected():
    with pytest.raises(ValueError, match=r"'ids'.*floating-point"):
        DMuon([{"params": [("ids", torch.zeros(4, 4, dtype=torch.int64))], "use_muon": True}])


def test_non_leaf_parameter_is_rejected():
    leaf = _matrix()
    with pytest.raises(ValueError, match=r"'w'.*not a leaf"):
        DMuon([("w", leaf * 2)])


def test_empty_params_list_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        DMuon([])


def test_empty_param_group_is_rejected():
    with pytest.raises(ValueError, match="param group 0 is empty"):
        DMuon([{"params": []}])


def test_non_tensor_param_is_rejected():
    with pytest.raises(TypeError, match=r"'param_groups\[0\]\[0\]' is a float, expected a torch.Tensor"):
        DMuon([1.0])


def test_a_single_tensor_as_params_is_rejected():
    with pytest.raises(TypeError, match="iterable of Tensors"):
        DMuon(_matrix())


def test_a_set_of_params_in_a_group_is_rejected():
    with pytest.raises(TypeError, match="not a set"):
        DMuon([{"params": {_matrix(), _matrix()}}])


def test_a_set_of_params_at_top_level_is_rejected():
    with pytest.raises(TypeError, match="set"):
        DMuon({_matrix(), _matrix()})


def test_group_without_params_is_rejected():
    with pytest.raises(ValueError, match="'params'"):
        DMuon([{"lr": 0.1}])


def test_param_in_two_groups_is_rejected():
    shared = _matrix()
    with pytest.raises(ValueError, match=r"'w'.*more than one param group"):
        DMuon([{"params": [shared]}, {"params": [("w", shared)]}])


def test_param_added_later_to_a_second_group_is_rejected():
    shared = _matrix()
    optimizer = DMuon([shared])
    with pytest.raises(ValueError, match="more than one param group"):
        optimizer.add_param_group({"params": [shared]})


def test_param_twice_in_one_group_is_rejected():
    shared = _matrix()
    with pytest.raises(ValueError, match="appears twice in param group 0"):
        DMuon([shared, shared])


def test_unknown_per_group_option_is_rejected_naming_it():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['momentun'\]"):
        DMuon([{"params": [_matrix()], "use_muon": True, "momentun": 0.9}])


def test_adamw_option_in_a_muon_group_is_rejected_naming_it():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['betas'\] for a Muon group"):
        DMuon([{"params": [_matrix()], "use_muon": True, "betas": (0.9, 0.95)}])


@pytest.mark.parametrize("use_muon", [1, "yes", 0.0])
def test_non_bool_use_muon_is_rejected(use_muon):
    with pytest.raises(TypeError, match="use_muon must be a bool"):
        DMuon([{"params": [_matrix()], "use_muon": use_muon}])


def test_non_dict_param_group_is_rejected():
    optimizer = DMuon([_matrix()])
    with pytest.raises(TypeError, match="param group must be a dict"):
        optimizer.add_param_group([_matrix()])


# ------------------------------------------------------------------ hyperparameters


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(lr=-0.1), r"lr must be in \[0.0, inf\), got -0.1"),
        (dict(lr=float("nan")), r"lr must be in"),
        (dict(momentum=-0.5), r"momentum must be in \[0.0, 1.0\), got -0.5"),
        (dict(momentum=1.0), r"momentum must be in \[0.0, 1.0\), got 1.0"),
        (dict(weight_decay=-1e-4), r"weight_decay must be in \[0.0, inf\)"),
        (dict(eps=0.0), r"eps must be in \(0.0, inf\)"),
        (dict(matched_adamw_rms=0.0), r"matched_adamw_rms must be in"),
        (dict(ns_steps=0), r"ns_steps must be an int in \[1, 100\), got 0"),
        (dict(ns_steps=100), r"ns_steps must be an int in \[1, 100\), got 100"),
        (dict(ns_steps=5.0), r"ns_steps must be an int in \[1, 100\), got 5.0"),
        (dict(ns_steps=True), r"ns_steps must be an int"),
        (dict(nesterov=1), r"nesterov must be a bool"),
        (dict(adjust_lr="rms"), r"unknown adjust_lr 'rms'"),
        (dict(ns_coefficients="polar"), r"unknown ns_coefficients 'polar'.*keller"),
        (dict(ns_coefficients=(3.4, -4.7)), r"ns_coefficients must be .* three finite numbers"),
        (dict(ns_coefficients=[(3.4, -4.7, 2.0), (1.0, 2.0)]), r"ns_coefficients must be .* list of such triples"),
        (dict(ns_coefficients=[]), r"ns_coefficients must be"),
        (dict(ns_coefficients=(3.4, float("inf"), 2.0)), r"ns_coefficients must be .* three finite numbers"),
        (dict(adamw_lr=-1.0), r"AdamW part\): lr must be in"),
        (dict(adamw_weight_decay=-1.0), r"AdamW part\): weight_decay must be in"),
        (dict(adamw_eps=-1e-8), r"AdamW part\): eps must be in"),
        (dict(adamw_betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
        (dict(adamw_betas=(-0.1, 0.9)), r"betas must be two numbers in \[0, 1\)"),
        (dict(adamw_betas=(0.9,)), r"betas must be two numbers"),
        (dict(comm="nccl"), r"unknown comm 'nccl'"),
        (dict(max_batch_numel=0), r"max_batch_numel must be a positive int"),
    ],
)
def test_bad_optimizer_option_is_rejected_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        DMuon([_matrix()], **options)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(adamw_betas=0.9), r"betas"),
        (dict(ns_coefficients=5), r"ns_coefficients"),
    ],
)
def test_non_iterable_option_is_rejected_naming_it(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DMuon([_matrix()], **options)


@pytest.mark.parametrize(
    "group, message",
    [
        (dict(use_muon=True, lr=-1.0), r"param group 0: lr must be in"),
        (dict(use_muon=True, momentum=1.5), r"param group 0: momentum must be in"),
        (dict(use_muon=True, ns_steps=0), r"param group 0: ns_steps must be"),
        (dict(use_muon=True, adjust_lr="rms"), r"param group 0: unknown adjust_lr"),
        (dict(use_muon=False, betas=(1.0, 0.9)), r"param group 0: betas must be"),
        (dict(use_muon=False, weight_decay=-0.1), r"param group 0: weight_decay must be"),
    ],
)
def test_bad_per_group_option_is_rejected_naming_the_group_and_option(group, message):
    with pytest.raises(ValueError, match=message):
        DMuon([{"params": [_matrix()], **group}])


# ------------------------------------------------------------------ gradients at step


def test_sparse_grad_in_muon_is_rejected_at_step():
    weight = _matrix()
    optimizer = DMuon([("w", weight)])
    weight.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(ValueError, match=r"'w'.*sparse"):
        optimizer.step()


def test_sparse_grad_in_adamw_is_rejected_at_step():
    weight = _matrix()
    optimizer = DMuon([{"params": [("emb", weight)], "use_muon": False}])
    weight.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(ValueError, match=r"'emb'.*sparse"):
        optimizer.step()


def test_complex_grad_in_muon_is_rejected_at_step():
    weight = _matrix()
    optimizer = DMuon([("w", weight)])
    weight.grad = torch.zeros(4, 4)
    weight.grad.data = torch.zeros(4, 4, dtype=torch.complex64)  # the grad setter would refuse it
    with pytest.raises(ValueError, match=r"'w'.*complex"):
        optimizer.step()


def test_grad_shape_mismatch_in_muon_is_rejected_at_step():
    weight = _matrix(4, 6)
    optimizer = DMuon([("w", weight)])
    weight.grad = torch.zeros(4, 6)
    weight.grad.data = torch.zeros(6, 4)  # the grad setter would refuse it
    with pytest.raises(ValueError, match=r"'w'.*gradient shape \(6, 4\) differs from the parameter's \(4, 6\)"):
        optimizer.step()


def test_rejected_muon_grad_leaves_every_param_and_state_untouched():
    good, bad = _matrix(), _matrix()
    before = [good.detach().clone(), bad.detach().clone()]
    optimizer = DMuon([good, bad])
    good.grad = torch.randn(4, 4)
    bad.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(ValueError):
        optimizer.step()
    assert torch.equal(good, before[0]) and torch.equal(bad, before[1])
    assert len(optimizer.state) == 0


def test_a_split_groups_eps_is_newton_schulzs_as_the_keyword_is():
    # DMuon(eps=...) sets Newton-Schulz's norm floor; a group without use_muon means the same
    # (issue 67: its AdamW part once took it as its epsilon). AdamW's is adamw_eps.
    net = torch.nn.Linear(8, 8)
    by_keyword = DMuon(list(net.named_parameters()), eps=1e-3)
    by_group = DMuon([{"params": list(net.named_parameters()), "eps": 1e-3}])
    assert [g["eps"] for g in by_group.param_groups] == [g["eps"] for g in by_keyword.param_groups] == [1e-3, 1e-8]
    assert DMuon([{"params": list(net.named_parameters()), "adamw_eps": 1e-3}]).param_groups[1]["eps"] == 1e-3
