"""DMuon's implementation flags, ``foreach`` and ``fused``, as torch.optim keeps them: the
AdamW part steps with ``torch.optim.AdamW``'s bits for the same flag, a param group may set
either for itself, and a combination torch.optim.AdamW refuses when it is built (a Tensor
lr with ``foreach=True``) is refused when DMuon is built, before any step.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from unittest import mock

import pytest
import torch
from torch import nn

from dmuon import DMuon
from tests.test_torch_optim_contract import ADAMW_LR, HYPER, MUON_LR, _assert_bitwise_equal, _run, _tiny_lm, _torch_pair

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]

# torch's own words for the combination it refuses (torch.optim.AdamW.__init__).
TORCH_TENSOR_LR_FOREACH = "lr as a Tensor is not supported for capturable=False and foreach=True"
# torch.optim.adam's three AdamW paths (torch.optim.adamw.adamw picks one by these names,
# 2.11 to 2.15); the fused one calls torch._fused_adamw_.
TORCH_ADAMW_PATHS = ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam")
TORCH_ADAM = importlib.import_module("torch.optim.adam")  # the module (torch.optim.adam is not an attribute)


def _matrix_and_vector() -> tuple[nn.Parameter, nn.Parameter]:
    torch.manual_seed(0)
    return nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))


# ------------------------------------------------------------------ the AdamW part's bits


def _adamw_params() -> list[nn.Parameter]:
    """Sizes with a vectorized body and a tail in torch's fused CPU AdamW."""
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(1037)), nn.Parameter(torch.randn(33, 7))]


def _adamw_run(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
    for step in range(3):
        for index, param in enumerate(params):
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(100 * step + index))
        optimizer.step()
    return [p.detach().clone() for p in params]


def _dmuon_adamw_part(**flags) -> list[torch.Tensor]:
    params = _adamw_params()
    return _adamw_run(DMuon([{"params": params, "use_muon": False}], lr=1e-2, weight_decay=0.1, **flags), params)


@pytest.mark.parametrize("flags", [dict(foreach=False), dict(foreach=True), dict(fused=True),
                                   dict(foreach=True, fused=True)],
                         ids=["for-loop", "foreach", "fused", "foreach+fused"])
def test_the_adamw_part_steps_with_torch_adamws_bits_for_the_same_flag(flags):
    """``foreach=True, fused=True`` is TorchTitan's ``"fused"``: list ops for Muon, torch's
    fused AdamW (which wins over foreach) for the AdamW part."""
    torch_flags = dict(fused=True) if flags.get("fused") else flags
    params = _adamw_params()
    expected = _adamw_run(torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **torch_flags),
                          params)
    _assert_bitwise_equal(_dmuon_adamw_part(**flags), expected)


@pytest.mark.parametrize("flags, path", [(dict(foreach=False), "_single_tensor_adam"),
                                         (dict(foreach=True), "_multi_tensor_adam"),
                                         (dict(fused=True), "_fused_adam"),
                                         (dict(foreach=True, fused=True), "_fused_adam")],
                         ids=["for-loop", "foreach", "fused", "foreach+fused"])
def test_the_adamw_part_runs_the_torch_adamw_path_its_flags_name(flags, path):
    """What makes the bitwise test above see the flag: the path that ran is watched, not
    told apart by rounding (on AVX-512 CPUs without AVX512_BF16 torch's fused CPU AdamW
    and its per-tensor loop give the same bits on these sizes)."""
    with contextlib.ExitStack() as stack:
        spies = {name: stack.enter_context(mock.patch.object(TORCH_ADAM, name, wraps=getattr(TORCH_ADAM, name)))
                 for name in TORCH_ADAMW_PATHS}
        kernel = stack.enter_context(mock.patch.object(torch, "_fused_adamw_", wraps=torch._fused_adamw_))
        _dmuon_adamw_part(**flags)
    assert {name for name, spy in spies.items() if spy.called} == {path}
    assert kernel.called == (path == "_fused_adam")


def test_dmuon_with_torchtitans_fused_flags_steps_like_torchs_muon_and_fused_adamw():
    dmuon = DMuon(_tiny_lm().named_parameters(), **HYPER, foreach=True, fused=True)
    _assert_bitwise_equal(_run([dmuon], range(3)), _run(_torch_pair(_tiny_lm(), fused=True), range(3)))


def test_a_fused_adamw_part_keeps_its_step_counter_where_torchs_fused_adamw_does():
    dmuon = DMuon(_tiny_lm().named_parameters(), **HYPER, fused=True)
    reference = _torch_pair(_tiny_lm(), fused=True)[1]
    _run([dmuon], range(1))
    _run([reference], range(1))
    ours = [dmuon.state[p]["step"] for g in dmuon.param_groups if not g["use_muon"] for p in g["params"]]
    theirs = [reference.state[p]["step"] for p in reference.param_groups[0]["params"]]
    assert [(s.device, s.dtype, s.item()) for s in ours] == [(s.device, s.dtype, s.item()) for s in theirs]


def test_a_fused_adamw_part_takes_a_tensor_lr_as_torchs_fused_adamw_does():
    lr = dict(lr=torch.tensor(MUON_LR), adamw_lr=torch.tensor(ADAMW_LR))
    dmuon = DMuon(_tiny_lm().named_parameters(), **dict(HYPER, **lr), fused=True)
    reference = _torch_pair(_tiny_lm(), muon_lr=lr["lr"], adamw_lr=lr["adamw_lr"], fused=True)
    _assert_bitwise_equal(_run([dmuon], range(2)), _run(reference, range(2)))


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_a_fused_that_is_not_a_bool_or_none_is_rejected_naming_it(value):
    with pytest.raises(ValueError, match=r"^DMuon: fused must be True, False or None"):
        DMuon(_matrix_and_vector(), fused=value)


def test_fused_for_a_parameter_torch_has_no_fused_kernel_for_is_refused_at_construction():
    matrix, _ = _matrix_and_vector()
    complex_vector = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"fused=True needs floating-point parameters .* 'bias' is torch.complex64"):
        DMuon([("weight", matrix), ("bias", complex_vector)], fused=True)


# ------------------------------------------------------------------ per-group flags


def test_foreach_and_fused_are_accepted_as_group_keys_and_kept_on_the_group():
    matrix, vector = _matrix_and_vector()
    dmuon = DMuon([{"params": [matrix], "use_muon": True, "foreach": True},
                   {"params": [vector], "use_muon": False, "foreach": False, "fused": True}])
    muon, adamw = dmuon.param_groups
    assert (muon["foreach"], "fused" in muon) == (True, False)
    assert (adamw["foreach"], adamw["fused"]) == (False, True)


def test_a_group_without_flags_keeps_no_flag_keys():
    """So a checkpoint's param-group keys stay what they were before the flags existed."""
    dmuon = DMuon(list(_matrix_and_vector()), foreach=True, fused=True)
    assert not any(key in group for group in dmuon.param_groups for key in ("foreach", "fused"))


def test_a_groups_foreach_steps_that_group_with_list_ops():
    matrix, other = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    dmuon = DMuon([{"params": [matrix], "use_muon": True, "foreach": True},
                   {"params": [other], "use_muon": True}], foreach=False)
    matrix.grad, other.grad = torch.randn(4, 4), torch.randn(4, 4)
    with mock.patch("torch._foreach_lerp_", wraps=torch._foreach_lerp_) as lerp:
        dmuon.step()
    listed = {id(t) for call in lerp.call_args_list for t in call.args[0]}
    assert listed == {id(dmuon.state[matrix]["momentum_buffer"])}


def test_a_groups_foreach_false_steps_its_adamw_part_one_tensor_at_a_time():
    """The group's value wins over the optimizer's, as torch reads ``group["foreach"]``."""
    _, vector = _matrix_and_vector()
    dmuon = DMuon([{"params": [vector], "use_muon": False, "foreach": False}], foreach=True)
    vector.grad = torch.randn(4)
    with mock.patch("torch._foreach_lerp_", wraps=torch._foreach_lerp_) as lerp:
        dmuon.step()
    assert lerp.call_count == 0


def test_a_groups_fused_steps_that_group_with_torchs_fused_adamw():
    params = _adamw_params()
    dmuon = DMuon([{"params": params[:1], "use_muon": False, "fused": True},
                   {"params": params[1:], "use_muon": False}], lr=1e-2, weight_decay=0.1, foreach=False)
    ours = _adamw_run(dmuon, params)
    params = _adamw_params()
    adamw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    expected = _adamw_run(torch.optim.AdamW([{"params": params[:1], "fused": True},
                                             {"params": params[1:], "foreach": False}], **adamw), params)
    _assert_bitwise_equal(ours, expected)


def test_a_split_groups_fused_goes_to_its_adamw_part_only():
    dmuon = DMuon([{"params": list(_matrix_and_vector()), "fused": True}])
    assert [(g["use_muon"], g.get("fused")) for g in dmuon.param_groups] == [(True, None), (False, True)]


def test_fused_true_in_a_muon_group_is_refused_naming_it():
    matrix, _ = _matrix_and_vector()
    with pytest.raises(ValueError, match=r"param group 0: fused=True has no path in a Muon group"):
        DMuon([{"params": [matrix], "use_muon": True, "fused": True}])


def test_a_group_foreach_that_is_not_a_bool_or_none_is_rejected_naming_the_group():
    with pytest.raises(ValueError, match=r"^DMuon param group 0: foreach must be True, False or None"):
        DMuon([{"params": list(_matrix_and_vector()), "foreach": "yes"}])


# ------------------------------------------------------------------ flags DMuon has no path for

NO_PATH_FLAGS = ["maximize", "differentiable"]  # capturable has a path: tests/test_capturable.py


@pytest.mark.parametrize("value", [False, None])
@pytest.mark.parametrize("flag", NO_PATH_FLAGS)
def test_torchs_flags_off_are_accepted_as_group_keys_and_kept_on_each_part(flag, value):
    dmuon = DMuon([{"params": list(_matrix_and_vector()), flag: value}])  # split: a Muon and an AdamW part
    assert [(g["use_muon"], g[flag]) for g in dmuon.param_groups] == [(True, value), (False, value)]


@pytest.mark.parametrize("flag", NO_PATH_FLAGS)
def test_torchs_flags_off_are_accepted_by_the_constructor_and_add_no_group_key(flag):
    dmuon = DMuon(list(_matrix_and_vector()), **{flag: False})
    assert not any(flag in group for group in dmuon.param_groups)


@pytest.mark.parametrize("flag", NO_PATH_FLAGS)
def test_a_torch_flag_set_true_in_a_group_is_refused_naming_it(flag):
    with pytest.raises(ValueError, match=rf"^DMuon param group 0: {flag}=True has no path in DMuon \(.+\); "
                                         rf"leave {flag} unset, False or None$"):
        DMuon([{"params": list(_matrix_and_vector()), flag: True}])


@pytest.mark.parametrize("flag", NO_PATH_FLAGS)
def test_a_torch_flag_set_true_in_the_constructor_is_refused_naming_it(flag):
    with pytest.raises(ValueError, match=rf"^DMuon: {flag}=True has no path in DMuon"):
        DMuon(list(_matrix_and_vector()), **{flag: True})


@pytest.mark.parametrize("flag", NO_PATH_FLAGS)
def test_a_torch_flag_that_is_not_a_bool_or_none_is_refused_naming_it(flag):
    with pytest.raises(ValueError, match=rf"^DMuon param group 0: {flag} must be False or None .* got 0$"):
        DMuon([{"params": list(_matrix_and_vector()), flag: 0}])


def test_groups_keeping_torchs_flags_round_trip_through_state_dict_and_step_alike():
    def build(params):
        return DMuon([{"params": params, "maximize": False, "capturable": None, "differentiable": False}])

    first = list(_matrix_and_vector())
    original = build(first)
    _adamw_run(original, first)
    again = list(_matrix_and_vector())
    with torch.no_grad():
        for param, value in zip(again, first):
            param.copy_(value)
    loaded = build(again)
    loaded.load_state_dict(copy.deepcopy(original.state_dict()))  # torch's load shares the tensors
    assert [{k: v for k, v in g.items() if k != "params"} for g in loaded.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in original.param_groups]
    _assert_bitwise_equal(_adamw_run(loaded, again), _adamw_run(original, first))


# ------------------------------------------------------------------ Tensor lr with foreach


def test_a_tensor_lr_with_foreach_is_refused_at_construction_as_torch_adamw_refuses_it():
    matrix, vector = _matrix_and_vector()
    with pytest.raises(ValueError, match=TORCH_TENSOR_LR_FOREACH):
        torch.optim.AdamW([vector], lr=torch.tensor(0.01), foreach=True)
    with pytest.raises(ValueError, match=rf"^DMuon \(AdamW part\): {TORCH_TENSOR_LR_FOREACH} .*adamw_lr"):
        DMuon([matrix, vector], lr=torch.tensor(0.01), foreach=True)


def test_a_tensor_lr_refused_with_foreach_leaves_no_parameter_changed():
    """Refused when built, so no step can half-apply (Muon moved, AdamW raised)."""
    matrix, vector = _matrix_and_vector()
    before = [matrix.detach().clone(), vector.detach().clone()]
    with pytest.raises(ValueError):
        DMuon([matrix, vector], lr=torch.tensor(0.01), foreach=True)
    assert torch.equal(matrix, before[0]) and torch.equal(vector, before[1])


def test_an_adamw_group_with_a_tensor_lr_and_foreach_is_refused_when_added():
    matrix, vector = _matrix_and_vector()
    dmuon = DMuon([matrix], foreach=True)
    with pytest.raises(ValueError, match=rf"^DMuon param group 1: {TORCH_TENSOR_LR_FOREACH}"):
        dmuon.add_param_group({"params": [vector], "use_muon": False, "lr": torch.tensor(0.01)})


@pytest.mark.parametrize("escape", [dict(adamw_lr=1e-3), dict(foreach=None), dict(fused=True)],
                         ids=["float adamw_lr", "foreach None", "fused"])
def test_a_tensor_lr_with_foreach_is_taken_where_the_adamw_part_has_a_path(escape):
    matrix, vector = _matrix_and_vector()
    options = dict(dict(lr=torch.tensor(0.01), foreach=True), **escape)
    dmuon = DMuon([matrix, vector], **options)
    matrix.grad, vector.grad = torch.randn(4, 4), torch.randn(4)
    dmuon.step()


def test_a_muon_group_takes_a_tensor_lr_with_foreach():
    """Muon's list ops take a Tensor lr; only the AdamW part follows torch.optim.AdamW."""
    matrix, _ = _matrix_and_vector()
    dmuon = DMuon([matrix], adamw_lr=1e-3, foreach=True)
    dmuon.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "use_muon": True, "lr": torch.tensor(0.01)})
