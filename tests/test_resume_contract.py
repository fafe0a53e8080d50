"""``DMuon.load_state_dict``'s resume contract (``dmuon.state.resume_contract``): options that may
change between a save and a resume come from the optimizer as constructed, each change
logged; options that change the state's layout are refused before anything loads; an
unchanged resume is bit for bit the uninterrupted run. One process, plain tensors, seeded.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

from dmuon import DMuon

pytestmark = pytest.mark.unit


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32, bias=True), nn.Linear(32, 8, bias=False))


def dmuon(net: nn.Module, **options) -> DMuon:
    return DMuon(list(net.named_parameters()), **{"lr": 0.02, "adamw_lr": 1e-3, "weight_decay": 0.1, **options})


def train(net: nn.Module, optimizer: DMuon, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


def saved_after_two_steps(**options):
    net = model()
    optimizer = dmuon(net, **options)
    train(net, optimizer, range(2))
    return net, optimizer.state_dict()


def resumed(net_state, state_dict, **options):
    """A fresh model and DMuon given the saved state (a copy: torch loads tensors by reference)."""
    net = model(seed=1)
    net.load_state_dict(net_state)
    optimizer = dmuon(net, **options)
    optimizer.load_state_dict(copy.deepcopy(state_dict))
    return net, optimizer


def test_an_unchanged_resume_continues_bit_for_bit(one_thread):
    net = model()
    optimizer = dmuon(net)
    train(net, optimizer, range(2))
    again, loaded = resumed(net.state_dict(), optimizer.state_dict())
    train(net, optimizer, range(2, 4))  # uninterrupted
    train(again, loaded, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters()))


def test_safe_options_come_from_the_constructed_optimizer_and_each_change_is_logged(caplog):
    net, state = saved_after_two_steps()
    with caplog.at_level(logging.INFO, logger="dmuon"):
        _, optimizer = resumed(net.state_dict(), state, ns_steps=1, momentum=0.5, qk_clip_threshold=0.1,
                               ns_coefficients="polar_express")
    muon, adamw = optimizer.param_groups
    assert (muon["ns_steps"], muon["momentum"], muon["qk_clip_threshold"]) == (1, 0.5, 0.1)
    assert muon["ns_coefficients"] == "polar_express"
    lines = [r.getMessage() for r in caplog.records]
    assert "DMuon: changed on resume: ns_steps 5 -> 1 (group 0)" in lines, lines
    assert "DMuon: changed on resume: momentum 0.95 -> 0.5 (group 0)" in lines, lines
    assert "DMuon: changed on resume: qk_clip_threshold None -> 0.1 (group 0)" in lines, lines
    # The state itself (momentum buffers, AdamW moments) is the saved one.
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], state["state"][0]["momentum_buffer"])


def test_a_changed_adamw_lr_reaches_the_adamw_group_and_changes_the_next_step(one_thread):
    net, state = saved_after_two_steps()
    same, unchanged = resumed(net.state_dict(), state)
    other, changed = resumed(net.state_dict(), state, adamw_lr=1e-2)
    assert changed.param_groups[1]["lr"] == 1e-2
    train(same, unchanged, range(2, 3))
    train(other, changed, range(2, 3))
    assert not torch.equal(same[0].bias, other[0].bias)  # a bias is in the AdamW part


def test_under_a_scheduler_a_changed_initial_lr_scales_the_saved_lr_and_keeps_the_schedule():
    net = model()
    optimizer = dmuon(net)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    train(net, optimizer, range(1))
    scheduler.step()  # the saved lr is half the initial one
    state = optimizer.state_dict()
    again = dmuon(model(seed=1), lr=0.04)
    torch.optim.lr_scheduler.LambdaLR(again, lambda step: 0.5 ** step)
    again.load_state_dict(state)
    assert again.param_groups[0]["initial_lr"] == 0.04
    assert again.param_groups[0]["lr"] == pytest.approx(0.02)  # 0.04 x the saved factor 0.5


@pytest.mark.parametrize(("saved", "now", "named"), [
    (dict(), dict(normuon=True), "group 0 normuon: saved False, now True"),
    (dict(normuon=True), dict(), "group 0 normuon: saved True, now False"),
])
def test_turning_normuon_on_or_off_is_refused_naming_the_key_before_anything_loads(saved, now, named):
    net, state = saved_after_two_steps(**saved)
    optimizer = dmuon(model(seed=1), **now)
    with pytest.raises(ValueError, match=named) as error:
        optimizer.load_state_dict(state)
    assert "exclude_from_loading optimizer" in str(error.value)
    assert not optimizer.state  # nothing was loaded


def test_a_different_number_of_groups_is_refused_with_the_scheduler_in_the_fix():
    net, state = saved_after_two_steps()
    fresh = model(seed=1)
    first, second = fresh[0], fresh[1]
    groups = [{"params": [first.weight], "use_muon": True, "split_rows": 8},
              {"params": [second.weight], "use_muon": True}, {"params": [first.bias], "use_muon": False}]
    optimizer = DMuon(groups, lr=0.02)
    with pytest.raises(ValueError, match=r"number of param groups \(saved 2, now 3.*lr_scheduler"):
        optimizer.load_state_dict(state)


def test_a_copy_keeps_the_contract():
    net, state = saved_after_two_steps()
    optimizer = copy.deepcopy(dmuon(model(seed=1), normuon=True))
    with pytest.raises(ValueError, match="normuon"):
        optimizer.load_state_dict(state)


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_a_saved_groups_own_flag_the_optimizer_leaves_unset_is_dropped_and_logged(one_thread, caplog, flag):
    # The checkpoint's run set the flag on its AdamW group; this run configures none: the group
    # steps with the optimizer's, as configured, not with the checkpoint's kernel (issue 67).
    net, state = saved_after_two_steps()
    state["param_groups"][1][flag] = True
    with caplog.at_level(logging.INFO, logger="dmuon"):
        _, optimizer = resumed(net.state_dict(), state, foreach=False, fused=False)
    assert flag not in optimizer.param_groups[1]
    assert f"DMuon: changed on resume: {flag} True -> unset (group 1)" in caplog.messages


def test_a_key_saved_in_a_group_not_of_its_kind_is_dropped(one_thread):
    net, state = saved_after_two_steps()
    state["param_groups"][0]["betas"] = (0.5, 0.5)  # an AdamW key in the Muon group
    state["param_groups"][1]["comm"] = "redistribute"  # a whole-optimizer option in a group
    _, optimizer = resumed(net.state_dict(), state)
    assert "betas" not in optimizer.param_groups[0] and "comm" not in optimizer.param_groups[1]
