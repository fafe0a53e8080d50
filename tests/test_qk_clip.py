"""QK-clip (MuonClip, Kimi K2 arXiv 2507.20534) in one process: the logit measurement
against a dense reference, the clip rule per attention kind, and DMuon's option, with
its errors. The multi-rank checks are tests/test_distributed_qk_clip.py.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from dmuon import AttentionHeads, DMuon
from dmuon.attention.qk_clip import FUSED_GROUPED, clip_factors, head_max_logits, row_scales

pytestmark = pytest.mark.unit

DIM, HEAD_DIM, SEQ = 16, 4, 6
THRESHOLD = 3.0


def _dense_max_logits(q, k, causal=True, visible=None):
    """Every logit materialized, masked, maxed: the definition."""
    group = q.shape[1] // k.shape[1]
    logits = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        mask = mask.tril()
    if visible is not None:
        mask = mask & visible
    return logits.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3))


# ---------------------------------------------------------------- measuring logits

@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_head_max_logits_equal_the_dense_causal_maximum(n_kv_heads):
    q, k = torch.randn(2, 4, SEQ, HEAD_DIM), torch.randn(2, n_kv_heads, SEQ, HEAD_DIM)
    torch.testing.assert_close(head_max_logits(q, k), _dense_max_logits(q, k))


def test_head_max_logits_without_causal_mask_see_every_key():
    q, k = torch.randn(2, 4, SEQ, HEAD_DIM), torch.randn(2, 4, SEQ, HEAD_DIM)
    torch.testing.assert_close(head_max_logits(q, k, causal=False), _dense_max_logits(q, k, causal=False))


def test_head_max_logits_honour_a_document_mask_mod():
    q, k = torch.randn(1, 2, SEQ, HEAD_DIM), torch.randn(1, 2, SEQ, HEAD_DIM)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1]])

    def same_document(b, h, q_idx, kv_idx):
        return documents[b, q_idx] == documents[b, kv_idx]

    visible = documents[0][:, None] == documents[0][None, :]
    torch.testing.assert_close(head_max_logits(q, k, mask_mod=same_document), _dense_max_logits(q, k, visible=visible))


def test_head_max_logits_do_not_depend_on_the_scratch_bound():
    q, k = torch.randn(2, 4, SEQ, HEAD_DIM), torch.randn(2, 2, SEQ, HEAD_DIM)
    assert torch.equal(head_max_logits(q, k, scratch_bytes=1), head_max_logits(q, k))


# ---------------------------------------------------------------- the rule

def test_clip_factors_shrink_only_the_heads_over_the_threshold():
    gamma = clip_factors(torch.tensor([1.0, 3.0, 6.0, -math.inf, math.nan]), THRESHOLD)
    assert gamma.tolist()[:4] == [1.0, 1.0, 0.5, 1.0] and gamma[4] == 1.0


def test_multi_head_attention_splits_the_factor_between_q_and_k():
    heads = AttentionHeads(2, 2, HEAD_DIM)
    q_rows, k_rows = row_scales(heads, torch.tensor([0.25, 1.0]))
    assert q_rows.tolist() == k_rows.tolist() == [0.5] * HEAD_DIM + [1.0] * HEAD_DIM


def test_grouped_query_attention_scales_queries_only():
    heads = AttentionHeads(4, 2, HEAD_DIM)
    q_rows, k_rows = row_scales(heads, torch.tensor([0.25, 1.0, 1.0, 0.5]))
    assert q_rows.tolist() == [0.25] * HEAD_DIM + [1.0] * 2 * HEAD_DIM + [0.5] * HEAD_DIM
    assert k_rows.tolist() == [1.0] * 2 * HEAD_DIM


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_fused_rows_get_the_factors_of_the_separate_weights(n_kv_heads):
    """TorchTitan 0.3's fused wqkv: per key head, its query heads' rows, its k rows, its v rows."""
    heads = AttentionHeads(4, n_kv_heads, HEAD_DIM)
    fused = AttentionHeads(4, n_kv_heads, HEAD_DIM, row_layout=FUSED_GROUPED)
    gamma = torch.tensor([0.25, 1.0, 0.5, 0.64])
    q_rows, k_rows = row_scales(heads, gamma)
    fq, fk = row_scales(fused, gamma)
    per_group = (fq * fk).view(n_kv_heads, -1, HEAD_DIM)
    group = 4 // n_kv_heads
    assert torch.equal(per_group[:, :group].flatten(), q_rows)
    assert torch.equal(per_group[:, group].flatten(), k_rows)
    assert torch.equal(per_group[:, group + 1], torch.ones(n_kv_heads, HEAD_DIM))


# ---------------------------------------------------------------- DMuon with QK-clip

class Attention(nn.Module):
    """A causal attention whose logits are large: weights of std ``gain``."""

    def __init__(self, n_heads, n_kv_heads, gain=2.0, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.heads = AttentionHeads(n_heads, n_kv_heads, HEAD_DIM)
        self.wq = nn.Parameter(torch.randn(n_heads * HEAD_DIM, DIM, generator=generator) * gain)
        self.wk = nn.Parameter(torch.randn(n_kv_heads * HEAD_DIM, DIM, generator=generator) * gain)
        self.wv = nn.Parameter(torch.randn(n_kv_heads * HEAD_DIM, DIM, generator=generator) * 0.3)
        self.tracker = None

    def qk(self, x):
        b = x.shape[0]
        q = (x @ self.wq.T).view(b, SEQ, -1, HEAD_DIM).transpose(1, 2)
        k = (x @ self.wk.T).view(b, SEQ, -1, HEAD_DIM).transpose(1, 2)
        return q, k

    def forward(self, x):
        q, k = self.qk(x)
        v = (x @ self.wv.T).view(x.shape[0], SEQ, -1, HEAD_DIM).transpose(1, 2)
        if self.tracker is not None:
            self.tracker.observe("attn", q, k, n_heads=self.heads.n_heads)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.sum()


def _train(model, threshold, steps=4, lr=0.01, weight_decay=0.0, quiet_head=None):
    """Train ``model`` on fixed batches; returns each step's max logits measured after the step."""
    if quiet_head is not None:
        with torch.no_grad():
            model.wq[quiet_head * HEAD_DIM : (quiet_head + 1) * HEAD_DIM] *= 0.001
    optimizer = DMuon([("wq", model.wq), ("wk", model.wk), ("wv", model.wv)], lr=lr, weight_decay=weight_decay,
                      qk_clip_threshold=threshold, telemetry=True)
    optimizer.clip_attention("attn", model.wq, model.wk, model.heads)
    model.tracker = optimizer.max_logits
    after = []
    for step in range(steps):
        x = torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).backward()
        optimizer.step()
        with torch.no_grad():
            after.append(head_max_logits(*model.qk(x)))
    return optimizer, after


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_every_step_ends_with_its_max_logit_at_or_under_the_threshold(n_kv_heads):
    """The clip uses the logits of the step's own forward and lands after the update,
    as in Kimi K2: what it bounds exactly is those logits under the clipped weights
    (next test). Measured on the step's batch after the step, the bound holds to within
    the update's own relative change, kept here below bf16 rounding by a small lr."""
    model = Attention(4, n_kv_heads)
    with torch.no_grad():
        assert head_max_logits(*model.qk(torch.randn(2, SEQ, DIM))).max() > 3 * THRESHOLD  # driven well over
    _, after = _train(model, THRESHOLD, lr=1e-4)
    bf16_rounding = 2.0**-8
    for logits in after:
        assert logits.max() <= THRESHOLD * (1 + bf16_rounding)


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_with_a_zero_step_every_clipped_head_lands_on_the_threshold(n_kv_heads):
    _, after = _train(Attention(4, n_kv_heads), THRESHOLD, steps=1, lr=0.0)
    torch.testing.assert_close(after[0], torch.full((4,), THRESHOLD), rtol=1e-5, atol=0)


def test_the_clip_scales_the_weights_after_the_update_lands():
    """Kimi K2's order: the step's update first, then each clipped head's rows scaled (under
    MHA by the square root of threshold / max logit for q and for k). Scaled first and then
    updated, the rows would differ by the update times (1 - factor)."""
    clipped_model, plain_model = Attention(4, 4), Attention(4, 4)
    optimizer, _ = _train(clipped_model, THRESHOLD, steps=1, lr=0.02)
    _train(plain_model, None, steps=1, lr=0.02)
    factor = (THRESHOLD / optimizer.last_max_logits()["attn"]).clamp(max=1.0).sqrt()
    rows = factor.repeat_interleave(HEAD_DIM)[:, None]
    torch.testing.assert_close(clipped_model.wq.detach(), plain_model.wq.detach() * rows, rtol=1e-6, atol=0)
    torch.testing.assert_close(clipped_model.wk.detach(), plain_model.wk.detach() * rows, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_heads_under_the_threshold_step_bit_for_bit_as_without_clip(n_kv_heads):
    """One step from the same state (a later step's update would differ anyway: Newton-
    Schulz mixes every head's rows of the matrix, and the clipped heads changed)."""
    quiet = 1
    clipped_model, plain_model = Attention(4, n_kv_heads), Attention(4, n_kv_heads)
    optimizer, _ = _train(clipped_model, THRESHOLD, steps=1, quiet_head=quiet)
    _train(plain_model, None, steps=1, quiet_head=quiet)
    assert optimizer.last_max_logits()["attn"][quiet] < THRESHOLD
    rows = slice(quiet * HEAD_DIM, (quiet + 1) * HEAD_DIM)
    assert torch.equal(clipped_model.wq[rows], plain_model.wq[rows])
    assert not torch.equal(clipped_model.wq, plain_model.wq)  # the other heads were clipped
    if n_kv_heads < 4:  # shared keys are never scaled
        assert torch.equal(clipped_model.wk, plain_model.wk)


def test_telemetry_shows_the_largest_logit_and_the_clipped_heads():
    optimizer, _ = _train(Attention(4, 4), THRESHOLD, steps=1, quiet_head=1)
    figures = optimizer.telemetry()
    assert figures.max_logit == pytest.approx(float(optimizer.last_max_logits()["attn"].max()))
    assert figures.max_logit > THRESHOLD and figures.qk_clipped_heads == 3


def test_without_a_threshold_logits_are_reported_and_nothing_is_clipped():
    optimizer, _ = _train(Attention(4, 4), None, steps=1)
    assert optimizer.telemetry().qk_clipped_heads == 0
    assert optimizer.telemetry().max_logit > THRESHOLD


def test_a_bf16_weight_is_scaled_in_float32_and_rounded_once():
    model = Attention(2, 2)
    weight = nn.Parameter(model.wq.detach().to(torch.bfloat16))
    key = nn.Parameter(model.wk.detach().to(torch.bfloat16))
    before = weight.detach().clone()
    optimizer = DMuon([("wq", weight), ("wk", key)], lr=0.0, qk_clip_threshold=THRESHOLD)
    optimizer.clip_attention("attn", weight, key, AttentionHeads(2, 2, HEAD_DIM))
    with torch.enable_grad():
        optimizer.max_logits.observe("attn", torch.ones(1, 2, SEQ, HEAD_DIM) * 4, torch.ones(1, 2, SEQ, HEAD_DIM),
                                     n_heads=2)  # logit 8 in both heads
    optimizer.step()
    factor = torch.tensor(THRESHOLD / 8.0).sqrt()
    assert torch.equal(weight.detach(), (before.float() * factor).to(torch.bfloat16))


def test_evaluation_forwards_are_not_counted():
    model = Attention(4, 4)
    optimizer = DMuon([("wq", model.wq), ("wk", model.wk)], qk_clip_threshold=THRESHOLD)
    optimizer.clip_attention("attn", model.wq, model.wk, model.heads)
    model.tracker = optimizer.max_logits
    with torch.no_grad():
        model(torch.randn(1, SEQ, DIM))
    assert torch.isinf(optimizer.max_logits.take("attn", 4, torch.device("cpu"))).all()


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, "100", True])
def test_a_bad_threshold_is_refused_naming_the_option(bad):
    with pytest.raises(ValueError, match="qk_clip_threshold must be None"):
        DMuon([nn.Parameter(torch.randn(4, 4))], qk_clip_threshold=bad)


def test_a_weight_of_the_wrong_shape_is_refused_naming_it():
    model = Attention(4, 2)
    optimizer = DMuon([("wq", model.wq), ("wk", model.wk)], qk_clip_threshold=THRESHOLD)
    with pytest.raises(ValueError, match=r"k_weight wk has shape \(8, 16\); .* needs 16 rows"):
        optimizer.clip_attention("attn", model.wq, model.wk, AttentionHeads(4, 4, HEAD_DIM))


def test_a_fused_layout_needs_one_weight():
    model = Attention(4, 4)
    optimizer = DMuon([("wq", model.wq), ("wk", model.wk)], qk_clip_threshold=THRESHOLD)
    with pytest.raises(ValueError, match="fused row layout has one weight"):
        optimizer.clip_attention("attn", model.wq, model.wk, AttentionHeads(4, 4, HEAD_DIM, row_layout=FUSED_GROUPED))


def test_an_attention_weight_outside_the_muon_groups_is_refused_at_the_step():
    model = Attention(4, 4)
    optimizer = DMuon([{"params": [model.wq], "use_muon": True}, {"params": [model.wk], "use_muon": False}],
                      qk_clip_threshold=THRESHOLD)
    optimizer.clip_attention("attn", model.wq, model.wk, model.heads)
    with pytest.raises(ValueError, match="k_weight .* is not a Muon parameter"):
        optimizer.step()


def test_an_attention_that_never_reports_while_others_do_is_refused_at_the_next_step():
    """Read from the step's reduced logits one step later: no host collective, no sync."""
    first, second = Attention(4, 4, seed=0), Attention(4, 4, seed=1)
    optimizer = DMuon([first.wq, first.wk, second.wq, second.wk], qk_clip_threshold=THRESHOLD)
    optimizer.clip_attention("first", first.wq, first.wk, first.heads)
    optimizer.clip_attention("second", second.wq, second.wk, second.heads)
    q, k = first.qk(torch.randn(1, SEQ, DIM))
    optimizer.max_logits.observe("first", q, k, n_heads=4)
    optimizer.step()
    with pytest.raises(ValueError, match=r"no attention logits for \['second'\] in the previous step"):
        optimizer.step()


def test_a_step_before_any_forward_warns_and_changes_nothing(caplog):
    model = Attention(4, 4)
    before = model.wq.detach().clone()
    optimizer = DMuon([model.wq, model.wk], qk_clip_threshold=THRESHOLD)
    optimizer.clip_attention("attn", model.wq, model.wk, model.heads)
    with caplog.at_level(logging.WARNING, logger="dmuon"):
        optimizer.step()
        optimizer.step()  # the warning reads the previous step's logits
    assert torch.equal(model.wq, before) and "no attention logits" in caplog.text


def test_heads_reported_outside_the_attention_are_refused():
    optimizer = DMuon([nn.Parameter(torch.randn(4, 4))])
    with torch.enable_grad(), pytest.raises(ValueError, match="pass the rank's first head as head_offset"):
        optimizer.max_logits.observe("attn", torch.randn(1, 2, SEQ, HEAD_DIM), torch.randn(1, 2, SEQ, HEAD_DIM),
                                     n_heads=4, head_offset=3)
