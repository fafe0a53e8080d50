"""DMuon keeps the torch.optim contract as torch.optim.Muon and AdamW keep it.

Each test gives DMuon and torch's optimizers the same inputs and expects the same
outcome: the same bits after a step, the same error, the same ``state_dict`` content.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from dmuon import DMuon
from dmuon.options.table import MUON_KEYS
from tests.test_optimizer_single_process import ADAMW_NAMES, MUON_NAMES, TORCH_MUON_DTYPE, TinyLM

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]

MUON_LR, ADAMW_LR, WEIGHT_DECAY = 0.02, 1e-3, 0.1
# DMuon's options that make it torch.optim.Muon (Muon part) plus torch.optim.AdamW (the rest).
HYPER = dict(lr=MUON_LR, adamw_lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, ns_dtype=TORCH_MUON_DTYPE)


def _tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _torch_pair(model: nn.Module, muon_lr=MUON_LR, adamw_lr=ADAMW_LR, **adamw) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon on the model's Muon matrices, AdamW on the rest (DMuon's routing)."""
    named = list(model.named_parameters())
    muon = torch.optim.Muon([(n, p) for n, p in named if n in MUON_NAMES], lr=muon_lr, weight_decay=WEIGHT_DECAY,
                            adjust_lr_fn="original")
    adamw = dict(dict(betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY), **adamw)
    return [muon, torch.optim.AdamW([(n, p) for n, p in named if n in ADAMW_NAMES], lr=adamw_lr, **adamw)]


def _params(*optimizers: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter, in group order (DMuon: Muon group first, as in ``_torch_pair``)."""
    return [p for opt in optimizers for g in opt.param_groups for p in g["params"]]


def _step(optimizers, step: int) -> None:
    for index, param in enumerate(_params(*optimizers)):
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(1000 * step + index))
    for optimizer in optimizers:
        optimizer.step()


def _run(optimizers, steps: range) -> list[torch.Tensor]:
    for step in steps:
        _step(optimizers, step)
    return [p.detach().clone() for p in _params(*optimizers)]


def _assert_bitwise_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected) > 0
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


# ------------------------------------------------------------------ copies


def _pickle_round_trip(optimizer):
    return pickle.loads(pickle.dumps(optimizer))


@pytest.mark.parametrize("copy_of", [copy.deepcopy, _pickle_round_trip], ids=["deepcopy", "pickle"])
def test_copied_optimizer_steps_bitwise_like_the_original_as_torch_optimizers_do(copy_of):
    dmuon = DMuon(_tiny_lm().named_parameters(), **HYPER)
    reference = _torch_pair(_tiny_lm())
    _run([dmuon], range(2))
    _run(reference, range(2))

    copies = copy_of(dmuon), [copy_of(opt) for opt in reference]

    public = {k for k in vars(dmuon) if not k.startswith("_")}
    assert {k for k in vars(copies[0]) if not k.startswith("_")} == public
    assert copies[0].defaults == dmuon.defaults  # still the keys a group may set
    expected = _run([dmuon], range(2, 3))
    _assert_bitwise_equal(_run([copies[0]], range(2, 3)), expected)
    _assert_bitwise_equal(_run(copies[1], range(2, 3)), expected)
    _assert_bitwise_equal(_run(reference, range(2, 3)), expected)


# What a pickle of a DMuon holds: torch.optim.Optimizer's own (defaults, state,
# param_groups), DMuon's configuration, and whether telemetry was on. Nothing derived
# from the parameters (the fast path's paths and owner plan, whose process groups do
# not pickle; the QK-clip registrations) and no measurement.
TORCH_PICKLED = {"defaults", "state", "param_groups"}
DMUON_CONFIGURATION = {"_muon_defaults", "_adamw_defaults", "_names", "_groups_added", "comm", "max_batch_numel",
                       "split_replicas", "ns_dtype", "link_gbps", "replica_link_gbps", "foreach", "fused",
                       "skip_nonfinite", "capturable"}


def test_a_pickle_holds_torchs_state_and_dmuons_configuration_and_nothing_derived():
    dmuon = DMuon(_tiny_lm().named_parameters(), **HYPER, telemetry=True)
    _run([dmuon], range(2))  # the first step derives the paths
    assert set(torch.optim.AdamW([nn.Parameter(torch.zeros(2))]).__getstate__()) == TORCH_PICKLED
    state = dmuon.__getstate__()
    assert set(state) == TORCH_PICKLED | DMUON_CONFIGURATION | {"telemetry_enabled"}
    assert state["telemetry_enabled"] is True


@pytest.mark.parametrize("key", MUON_KEYS)
def test_a_state_dict_whose_group_lacks_an_option_is_refused_naming_it(key):
    """No release wrote a state dict without an option of the table: a group without one is
    refused before anything loads, not filled in (a missing ``normuon`` once turned NorMuon off)."""
    model = _tiny_lm()
    dmuon = DMuon(model.named_parameters(), **HYPER, normuon=True)
    _run([dmuon], range(1))
    saved = copy.deepcopy(dmuon.state_dict())
    del saved["param_groups"][0][key]
    loaded = DMuon(copy.deepcopy(model).named_parameters(), **HYPER, normuon=True)
    before = copy.deepcopy(loaded.state_dict())
    with pytest.raises(ValueError, match=rf"group 0 was saved without the option\(s\) \['{key}'\]"):
        loaded.load_state_dict(saved)
    assert str(loaded.state_dict()) == str(before)


# ------------------------------------------------------------------ Tensor lr


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_one_element_tensor_lr_of_any_shape_steps_bitwise_like_torch(shape):
    def tensor(value: float) -> torch.Tensor:
        return torch.tensor(value).reshape(shape)

    dmuon = DMuon(_tiny_lm().named_parameters(), **dict(HYPER, lr=tensor(MUON_LR), adamw_lr=tensor(ADAMW_LR)))
    reference = _torch_pair(_tiny_lm(), muon_lr=tensor(MUON_LR), adamw_lr=tensor(ADAMW_LR))
    with_floats = DMuon(_tiny_lm().named_parameters(), **dict(HYPER, lr=tensor(MUON_LR).item(),
                                                              adamw_lr=tensor(ADAMW_LR).item()))

    ours = _run([dmuon], range(3))

    _assert_bitwise_equal(ours, _run(reference, range(3)))
    # torch computes with a Tensor lr in the Tensor's dtype and with a float in float64,
    # so the two may differ in the last bit (torch.optim.AdamW and Muon alike).
    for a, e in zip(ours, _run([with_floats], range(3))):
        torch.testing.assert_close(a, e)


def test_tensor_lr_with_more_than_one_element_is_refused_like_torch():
    matrix, vector, two = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4)), torch.tensor([0.01, 0.02])
    for optimizer_class in (torch.optim.Muon, torch.optim.AdamW):
        with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
            optimizer_class([matrix], lr=two)
    with pytest.raises(ValueError, match=r"^DMuon: a Tensor lr must be 1-element .*got shape \(2,\)"):
        DMuon([matrix], lr=two)
    with pytest.raises(ValueError, match=r"AdamW part\): a Tensor lr must be 1-element"):
        DMuon([matrix], adamw_lr=two)
    optimizer = DMuon([matrix])
    with pytest.raises(ValueError, match=r"param group 1: a Tensor lr must be 1-element"):
        optimizer.add_param_group({"params": [vector], "lr": two})


# ------------------------------------------------------------------ names


MIXED_NAMES = {
    "in one group": lambda w, b: [("w", w), b],
    "named then unnamed group": lambda w, b: [{"params": [("w", w)]}, {"params": [b]}],
    "unnamed then named group": lambda w, b: [{"params": [w]}, {"params": [("b", b)]}],
}


@pytest.mark.parametrize("layout", MIXED_NAMES.values(), ids=MIXED_NAMES.keys())
def test_named_and_unnamed_parameters_mixed_are_refused_in_torchs_words(layout):
    """torch's message is part of DMuon's, so code that matches on it keeps working."""
    def params():
        return layout(nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4)))

    with pytest.raises(ValueError, match="with/without names") as theirs:
        torch.optim.AdamW(params())
    with pytest.raises(ValueError, match=r"\(name, tensor\) pairs") as ours:
        DMuon(params())
    assert str(theirs.value) in str(ours.value)


def test_state_dict_param_groups_keep_each_half_s_param_names_like_torch():
    model = _tiny_lm()
    dmuon = DMuon(model.named_parameters())  # one group, split into Muon and AdamW
    reference = _torch_pair(model)

    ours = [g["param_names"] for g in dmuon.state_dict()["param_groups"]]
    theirs = [g["param_names"] for opt in reference for g in opt.state_dict()["param_groups"]]

    assert ours == theirs and len(ours) == 2
    assert ours == [[dmuon.param_name(p) for p in g["params"]] for g in dmuon.param_groups]


def test_param_names_given_as_a_group_key_name_bare_tensors_like_torch():
    """A group as torch.optim keeps it (``params`` plus ``param_names``) is taken as such."""
    matrix, vector = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    theirs = torch.optim.AdamW([{"params": [matrix, vector], "param_names": ["w", "b"]}])
    ours = DMuon([{"params": [matrix, vector], "param_names": ["w", "b"], "use_muon": False}])

    assert ours.param_groups[0]["param_names"] == theirs.param_groups[0]["param_names"] == ["w", "b"]
    assert ours.param_name(vector) == "b"
    with pytest.raises(ValueError, match="param_names must be one str per parameter"):
        DMuon([{"params": [matrix, vector], "param_names": ["w"]}])


def test_param_names_survive_torchtitans_flattened_checkpoint_round_trip_bitwise(one_rank_gloo, tmp_path):
    """TorchTitan's way: get_optimizer_state_dict(flatten_optimizer_state_dict=True),
    dcp.save, then dcp.load into a fresh optimizer's flat dict and set_optimizer_state_dict."""
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = _tiny_lm()
    original = DMuon(model.named_parameters(), **HYPER)
    _run([original], range(2))
    dcp.save({"optimizer": get_optimizer_state_dict(model, original, options=options)}, checkpoint_id=str(tmp_path))
    restored_model = copy.deepcopy(model)
    restored = DMuon(restored_model.named_parameters(), **HYPER)

    flat = get_optimizer_state_dict(restored_model, restored, options=options)
    dcp.load({"optimizer": flat}, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(restored_model, restored, flat, options=options)

    assert flat["param_groups.norm.weight.param_names"] == original.param_groups[1]["param_names"]
    assert [g["param_names"] for g in restored.param_groups] == [g["param_names"] for g in original.param_groups]
    _assert_bitwise_equal(_run([restored], range(2, 4)), _run([original], range(2, 4)))
    for p, q in zip(_params(restored), _params(original)):
        _assert_bitwise_equal(list(restored.state[p].values()), list(original.state[q].values()))


# ------------------------------------------------------------------ group keys


def test_adamw_keys_in_a_split_group_set_its_adamw_half_like_torch_adamw():
    adamw = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    group = dict(lr=MUON_LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR, **{f"adamw_{k}": v for k, v in adamw.items()})
    dmuon = DMuon([{"params": list(_tiny_lm().named_parameters()), **group}], ns_dtype=TORCH_MUON_DTYPE)
    reference = _torch_pair(_tiny_lm(), **adamw)

    _assert_bitwise_equal(_run([dmuon], range(2)), _run(reference, range(2)))


def test_adamw_keys_in_a_use_muon_false_group_mean_the_plain_keys_and_win_over_them():
    vectors = [nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    theirs = [nn.Parameter(v.detach().clone()) for v in vectors]
    plain = dict(lr=0.5, betas=(0.5, 0.5), eps=1e-3, weight_decay=0.5)  # each overridden below
    adamw = dict(lr=ADAMW_LR, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    dmuon = DMuon([{"params": vectors, "use_muon": False, **plain, **{f"adamw_{k}": v for k, v in adamw.items()}}])
    reference = torch.optim.AdamW(theirs, **adamw)

    _assert_bitwise_equal(_run([dmuon], range(2)), _run([reference], range(2)))


def test_a_group_may_set_every_key_of_defaults_like_torch():
    """A group holding every key of ``defaults`` is accepted and rebuilds the same groups."""
    for optimizer_class, make in ((torch.optim.Muon, lambda: [nn.Parameter(torch.zeros(4, 4))]),
                                  (torch.optim.AdamW, lambda: [nn.Parameter(torch.zeros(4))]),
                                  (DMuon, lambda: list(_tiny_lm().named_parameters()))):
        kwargs = dict(lr=0.03, weight_decay=0.2) | (dict(adamw_lr=ADAMW_LR, adamw_betas=(0.8, 0.9)) if optimizer_class is DMuon else {})
        first = optimizer_class(make(), **kwargs)
        again = optimizer_class([{"params": make(), **first.defaults}])

        def options(optimizer):
            return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

        assert options(again) == options(first), optimizer_class.__name__


# ------------------------------------------------------------------ signature


def test_options_after_lr_are_keyword_only_and_lr_stays_positional_as_in_torch_muon():
    kinds = {name: p.kind for name, p in inspect.signature(DMuon).parameters.items()}
    assert [name for name, kind in kinds.items() if kind != inspect.Parameter.KEYWORD_ONLY] == ["params", "lr"]
    with pytest.raises(TypeError, match="positional"):
        DMuon([nn.Parameter(torch.zeros(4, 4))], 0.02, 0.9)

    ours, theirs = (nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0))) for _ in range(2))
    dmuon = DMuon([ours], 0.05, ns_dtype=TORCH_MUON_DTYPE)
    reference = torch.optim.Muon([theirs], 0.05, weight_decay=0.0, adjust_lr_fn="original")
    _assert_bitwise_equal(_run([dmuon], range(2)), _run([reference], range(2)))
