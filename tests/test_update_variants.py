"""NorMuon and cautious weight decay (issue 16) against tiny transcriptions of the
papers' equations, written here independently of dmuon's code, and the options'
rules. Newton-Schulz itself is not under test: the references call dmuon's.

- NorMuon (Li et al., arXiv 2510.05491; official normuon.py): per matrix O = NS(U),
  v = beta2 v + (1 - beta2) mean_j O_ij^2, N = O / (sqrt(v) + eps),
  N *= ||O||_F / ||N||_F, W = W (1 - lr wd) - lr sqrt(max(1, A/B)) N.
- Cautious weight decay (Chen et al., arXiv 2510.12402, Algorithm 1):
  x = x - lr (u + wd I(u x >= 0) x).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dmuon import DMuon
from tests.muon_reference import apply_muon_update_, newton_schulz
from dmuon.numerics.newton_schulz import KELLER_COEFFICIENTS
from dmuon.numerics.device_scalars import StepScalars
from dmuon.numerics.update_rules import cautious_decay_, cautious_mask, decay_factor, normuon_normalize_

pytestmark = pytest.mark.unit

LR, WD, MOMENTUM, BETA2, STEPS = 0.05, 0.1, 0.9, 0.9, 3


def _grads(shape, steps=STEPS, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(steps)]


def _ns(update):
    return newton_schulz(update, ns_coefficients=KELLER_COEFFICIENTS, ns_steps=5, eps=1e-7,
                         ns_dtype=torch.float32, split_rows=None)


def _reference_muon(w, grads, *, normuon, cautious):
    """Muon (torch semantics, Nesterov) with the papers' variants, row by row of the equations."""
    w = w.clone()
    buf = torch.zeros_like(w)
    v = torch.zeros(w.shape[0], 1)
    rows, cols = w.shape
    for g in grads:
        buf = MOMENTUM * buf + (1 - MOMENTUM) * g
        u = (1 - MOMENTUM) * g + MOMENTUM * buf
        o = _ns(u.bfloat16()).float()
        if normuon:
            v = BETA2 * v + (1 - BETA2) * (o ** 2).mean(dim=1, keepdim=True)
            n = o / (v.sqrt() + 1e-10)
            o = n * (o.norm() / n.norm())
        step = math.sqrt(max(1, rows / cols)) * o
        decay = (step * w >= 0).float() if cautious else torch.ones_like(w)
        w = w - LR * (step + WD * decay * w)
    return w, v


def _dmuon_muon(w, grads, **options):
    param = nn.Parameter(w.clone())
    optimizer = DMuon([param], lr=LR, momentum=MOMENTUM, weight_decay=WD, ns_dtype="float32",
                      normuon_beta2=BETA2, **options)
    for g in grads:
        param.grad = g
        optimizer.step()
    return param.detach(), optimizer.state[param]


@pytest.mark.parametrize("shape", [(12, 8), (6, 10)])
def test_normuon_matches_the_papers_equations(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    expected, expected_v = _reference_muon(w, _grads(shape), normuon=True, cautious=False)
    got, state = _dmuon_muon(w, _grads(shape), normuon=True)
    # dmuon rounds the normalized update to bf16 (the wire dtype): 2^-9 relative per entry.
    torch.testing.assert_close(got, expected, rtol=0, atol=LR * 4 * 2 ** -8)
    torch.testing.assert_close(state["normuon_second_moment"], expected_v, rtol=1e-5, atol=0)


def test_normuon_changes_the_update():
    w = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(_dmuon_muon(w, _grads((12, 8)), normuon=True)[0], _dmuon_muon(w, _grads((12, 8)))[0])


def test_normuon_keeps_the_frobenius_norm_of_the_orthogonalized_update():
    ortho = _ns(torch.randn(16, 8).bfloat16())
    normalized = normuon_normalize_(ortho, torch.rand(16, 1), 0.95)
    torch.testing.assert_close(normalized.float().norm(), ortho.float().norm(), rtol=2 ** -7, atol=0)


def test_normuon_of_a_stack_is_each_matrix_alone_bitwise():
    """What the owner of one expert relies on: its bits are the stack's."""
    ortho = torch.randn(3, 6, 5).bfloat16()
    moments = torch.rand(3, 6, 1)
    each = [normuon_normalize_(ortho[e].clone(), moments[e].clone(), 0.9) for e in range(3)]
    stacked_moments = moments.clone()
    stacked = normuon_normalize_(ortho.clone(), stacked_moments, 0.9)
    assert all(torch.equal(stacked[e], each[e]) for e in range(3))


def test_normuon_with_split_rows_normalizes_each_row_block_as_its_own_matrix():
    ortho = torch.randn(8, 5).bfloat16()
    whole = normuon_normalize_(ortho.clone(), torch.zeros(8, 1), 0.9, split_rows=4)
    blocks = [normuon_normalize_(ortho[i:i + 4].clone(), torch.zeros(4, 1), 0.9) for i in (0, 4)]
    assert torch.equal(whole, torch.cat(blocks))


def test_normuon_state_has_one_entry_per_matrix_row():
    params = [nn.Parameter(torch.randn(shape)) for shape in [(6, 4), (3, 6, 4), (5, 2, 3, 3)]]
    optimizer = DMuon([{"params": params, "use_muon": True, "normuon": True}])
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    shapes = [tuple(optimizer.state[p]["normuon_second_moment"].shape) for p in params]
    assert shapes == [(6, 1), (3, 6, 1), (5, 1)]


@pytest.mark.parametrize("shape", [(12, 8), (6, 10)])
def test_cautious_weight_decay_in_muon_matches_the_papers_equation(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    expected, _ = _reference_muon(w, _grads(shape), normuon=False, cautious=True)
    got, _ = _dmuon_muon(w, _grads(shape), cautious_weight_decay=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_cautious_weight_decay_changes_the_muon_update():
    w = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    cautious = _dmuon_muon(w, _grads((12, 8)), cautious_weight_decay=True)[0]
    assert not torch.equal(cautious, _dmuon_muon(w, _grads((12, 8)))[0])


def test_the_cautious_mask_counts_a_zero_on_either_side_as_agreeing():
    update = torch.tensor([1.0, -1.0, 1.0, 0.0, 2.0, -0.0])
    param = torch.tensor([2.0, -3.0, -1.0, 5.0, 0.0, -4.0])
    assert cautious_mask(update, param).tolist() == [True, True, False, True, True, True]


def test_cautious_decay_where_every_sign_agrees_is_the_plain_decay_bitwise():
    param = torch.rand(7, 5) + 0.1
    ortho = (torch.rand(7, 5) + 0.1).bfloat16()
    plain, cautious = param.clone(), param.clone()
    apply_muon_update_(plain, ortho, 0.03, 0.2, 1.5)
    apply_muon_update_(cautious, ortho, 0.03, 0.2, 1.5, cautious_weight_decay=True)
    assert torch.equal(cautious, plain)


def test_cautious_decay_leaves_disagreeing_entries_alone():
    param = torch.tensor([1.0, -2.0, 3.0])
    cautious_decay_(param, torch.tensor([-1.0, 1.0, 1.0]), decay_factor(1 - 0.5 * 0.1, param.dtype, StepScalars())[0])
    assert param.tolist() == [1.0, -2.0, torch.tensor(3.0 * (1 - 0.05)).item()]


def _reference_adamw(w, grads, betas=(0.9, 0.95), eps=1e-8):
    """AdamW (bias-corrected) with cautious weight decay, from the equations."""
    w, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        u = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
        w = w - LR * (u + WD * (u * w >= 0).float() * w)
    return w


def test_cautious_weight_decay_in_adamw_matches_the_papers_equation():
    w = torch.randn(20, generator=torch.Generator().manual_seed(0))
    param = nn.Parameter(w.clone())
    optimizer = DMuon([{"params": [param], "use_muon": False, "cautious_weight_decay": True}], lr=LR,
                      weight_decay=WD)
    for g in _grads((20,)):
        param.grad = g
        optimizer.step()
    torch.testing.assert_close(param.detach(), _reference_adamw(w, _grads((20,))), rtol=1e-5, atol=1e-6)


def test_the_variants_are_off_by_default():
    group = DMuon([nn.Parameter(torch.randn(4, 4))]).param_groups[0]
    assert (group["normuon"], group["cautious_weight_decay"]) == (False, False)


@pytest.mark.parametrize("options, message", [
    (dict(normuon=1), "DMuon: normuon must be a bool (True or False), got 1"),
    (dict(normuon_beta2=1.0), "DMuon: normuon_beta2 must be in [0.0, 1.0), got 1.0"),
    (dict(normuon_beta2=-0.1), "DMuon: normuon_beta2 must be in [0.0, 1.0), got -0.1"),
    (dict(cautious_weight_decay="yes"), "DMuon: cautious_weight_decay must be a bool (True or False), got 'yes'"),
])
def test_a_bad_variant_option_is_rejected_naming_it(options, message):
    with pytest.raises(ValueError) as error:
        DMuon([nn.Parameter(torch.randn(4, 4))], **options)
    assert str(error.value) == message


def test_normuon_in_an_adamw_group_is_an_unknown_option():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['normuon'\] for an AdamW group"):
        DMuon([{"params": [nn.Parameter(torch.randn(4))], "use_muon": False, "normuon": True}])
