"""QK-clip from a TorchTitan 0.2 TOML: the ``[optimizer] qk_clip_threshold`` and
``track_max_logits`` fields, the attention hooks (torchtitan_ext/titan02/max_logits.py),
the step line's figures, and one short 2-rank run that clips.

In-process tests build TorchTitan's llama3/qwen3 modules directly (no process group);
the end-to-end test launches ``torchrun`` as tests/test_torchtitan_e2e.py does.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torchtitan.config import ConfigManager
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.utils import NoColor

import torchtitan_ext.titan02.job  # noqa: F401  (registers the DMuon-aware train specs)
from dmuon import DMuon
from dmuon.attention.qk_clip import head_max_logits
from dmuon.step.telemetry import StepFigures
from torchtitan_ext.step_figures import console_text, metric_values
from torchtitan_ext.titan02.kwargs import dmuon_kwargs
from torchtitan_ext.titan02.max_logits import QKClipUnsupported
from torchtitan_ext.titan_log import parse_log

EXT = ["--job.custom_config_module", "torchtitan_ext", "--experimental.custom_import", "torchtitan_ext.titan02.job",
       "--optimizer.name", "DMuon"]


def optimizer_config(*args: str):
    return ConfigManager().parse_args([*EXT, *args]).optimizer


def tiny_llama(n_kv_heads: int | None = None) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=128,
                                            max_seq_len=32))


def build(model, *args: str):
    return get_train_spec("llama3").build_optimizers_fn([model], optimizer_config(*args), None)


# ----------------------------------------------------------------- the [optimizer] fields


@pytest.mark.unit
@pytest.mark.parametrize("text", ["-1", "nan", "inf"])
def test_a_bad_qk_clip_threshold_is_refused_with_dmuons_message_naming_the_field(text):
    with pytest.raises(ValueError) as from_toml:
        optimizer_config(f"--optimizer.qk_clip_threshold={text}")
    with pytest.raises(ValueError) as from_dmuon:
        DMuon([nn.Parameter(torch.zeros(4, 4))], qk_clip_threshold=float(text))
    dmuon_rule = str(from_dmuon.value).removeprefix("DMuon")
    assert str(from_toml.value) == f"[optimizer]{dmuon_rule}; in TOML, qk_clip_threshold = 0 turns QK-clip off"


@pytest.mark.unit
def test_qk_clip_threshold_zero_is_dmuons_none_and_a_positive_value_passes_through():
    assert dmuon_kwargs(optimizer_config())["qk_clip_threshold"] is None
    assert dmuon_kwargs(optimizer_config("--optimizer.qk_clip_threshold", "100"))["qk_clip_threshold"] == 100.0


@pytest.mark.unit
def test_without_qk_clip_no_attention_is_hooked():
    model = tiny_llama()
    build(model)
    assert not any(layer.attention.inner_attention._forward_pre_hooks for layer in model.layers.values())


# ----------------------------------------------------------------- the hooks


def _train_step(model, container, tokens):
    container.zero_grad()
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    container.step()


@pytest.mark.unit
@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_the_hook_reports_the_per_head_maxima_of_the_q_and_k_the_attention_computes(n_kv_heads):
    model = tiny_llama(n_kv_heads)
    container = build(model, "--optimizer.track_max_logits")
    seen = {}  # our own hook, next to the extension's: the q and k each attention hands to SDPA
    for name, layer in model.layers.items():
        layer.attention.inner_attention.register_forward_pre_hook(
            lambda _m, args, name=name: seen.__setitem__(f"layers.{name}.attention", (args[0], args[1])))
    _train_step(model, container, torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0)))
    (optimizer,) = container.optimizers
    reported = optimizer.last_max_logits()
    assert sorted(reported) == sorted(seen) == ["layers.0.attention", "layers.1.attention"]
    for name, (q, k) in seen.items():
        torch.testing.assert_close(reported[name], head_max_logits(q.detach(), k.detach()), rtol=0, atol=0)


@pytest.mark.unit
def test_a_steps_max_logits_are_its_own_when_they_fall_below_the_last_steps():
    # The hook's slot is emptied when the step takes it: the second step reports its own
    # (smaller) maxima, not the largest since the run began (issue 67, item 5).
    model = tiny_llama()
    container = build(model, "--optimizer.track_max_logits", "--optimizer.lr", "0", "--optimizer.adamw_lr", "0")
    (optimizer,) = container.optimizers
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    _train_step(model, container, tokens)
    first = optimizer.last_max_logits()
    seen = {}  # our own hook, next to the extension's: the second step's q and k of each attention
    with torch.no_grad():  # halve every query: the logits fall
        for name, layer in model.layers.items():
            layer.attention.wq.weight.mul_(0.5)
            layer.attention.inner_attention.register_forward_pre_hook(
                lambda _m, args, name=name: seen.__setitem__(f"layers.{name}.attention", (args[0], args[1])))
    _train_step(model, container, tokens)
    second = optimizer.last_max_logits()
    assert sorted(second) == sorted(seen) == ["layers.0.attention", "layers.1.attention"]
    for name, (q, k) in seen.items():
        assert bool((second[name] < first[name]).all()), "the test data do not lower the logits"
        torch.testing.assert_close(second[name], head_max_logits(q.detach(), k.detach()), rtol=0, atol=0)


@pytest.mark.unit
def test_a_low_threshold_clips_heads_and_the_step_figures_say_how_many():
    model = tiny_llama()
    container = build(model, "--optimizer.qk_clip_threshold", "0.01", "--optimizer.telemetry")
    _train_step(model, container, torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0)))
    figures = container.telemetry()
    assert figures.max_logit > 0.01 and figures.qk_clipped_heads == 8  # 2 layers x 4 heads


@pytest.mark.unit
def test_under_flex_attention_the_hook_applies_the_block_masks_mask_mod():
    from types import SimpleNamespace

    from torchtitan.models.attention import get_document_mask_mod

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=128, max_seq_len=32,
                                             attn_type="flex"))
    (optimizer,) = build(model, "--optimizer.track_max_logits").optimizers
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    # Two documents per sequence (token 5 ends the first); FlexAttention on CPU has no
    # backward, so the hook is called as the module would call it, with a stand-in mask.
    tokens = torch.tensor([[1, 2, 5, 3, 4, 6, 7, 8], [1, 5, 2, 3, 4, 6, 7, 8]])
    mask_mod = get_document_mask_mod(tokens, eos_id=5)
    inner = model.layers["0"].attention.inner_attention
    for hook in inner._forward_pre_hooks.values():
        hook(inner, (q, k, k), {"block_mask": SimpleNamespace(mask_mod=mask_mod)})
    expected = head_max_logits(q, k, causal=False, mask_mod=mask_mod)
    assert not torch.equal(expected, head_max_logits(q, k))  # the mask matters here
    torch.testing.assert_close(optimizer.max_logits.take("layers.0.attention", 4, q.device), expected, rtol=0, atol=0)


@pytest.mark.unit
def test_mla_attention_is_refused_naming_the_module():
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import Attention

    part = nn.Module()
    part.attention = Attention(DeepSeekV3ModelArgs(dim=64, n_heads=4, q_lora_rank=0, kv_lora_rank=16,
                                                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8))
    part.output = nn.Linear(64, 8, bias=False)
    with pytest.raises(QKClipUnsupported, match=r"attention 'attention' .*no wq/wk projections \(MLA"):
        build(part, "--optimizer.qk_clip_threshold", "100")


@pytest.mark.unit
def test_qk_norm_attention_is_refused_naming_the_module():
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    model = Qwen3Model(Qwen3ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                                      vocab_size=128, max_seq_len=32, qk_norm=True))
    with pytest.raises(QKClipUnsupported, match=r"attention 'layers\.0\.attention' .*QK-norm.*turn QK-clip off.*qk_clip_threshold"):
        get_train_spec("qwen3").build_optimizers_fn([model], optimizer_config("--optimizer.qk_clip_threshold", "100"),
                                                    None)


# ----------------------------------------------------------------- the step line


@pytest.mark.unit
def test_the_step_line_and_metrics_show_qk_clip_figures_only_when_it_is_on():
    off = StepFigures.from_sums(0.15, 0.1, 2**20, [4.0, 100.0, 400.0, 1.0, 25.0, 100.0])
    on = StepFigures.from_sums(0.15, 0.1, 2**20, [4.0, 100.0, 400.0, 1.0, 25.0, 100.0],
                               max_logit=31.5, qk_clipped_heads=7)
    assert "max_logit" not in console_text(off, NoColor()) and "dmuon/max_logit" not in metric_values(off)
    line = console_text(on, NoColor())
    assert line.endswith("  max_logit: 31.50  clipped_heads: 7")
    assert metric_values(on)["dmuon/qk_clipped_heads"] == 7
    parsed = parse_log(f"[titan] 2026-11-23 10:00:00,000 - root - INFO - step:  3  loss:  2.50000  {line}")
    assert parsed.telemetry[3]["max_logit"] == 31.5 and parsed.telemetry[3]["qk_clipped_heads"] == 7


# ----------------------------------------------------------------- end to end


@pytest.mark.torchrun
def test_a_two_rank_run_with_a_low_threshold_clips_heads_on_every_step_and_still_learns(tmp_path, short_run_args):
    from tests.titan_runs import DMUON_TOML, torchrun

    log, _ = torchrun(DMUON_TOML, tmp_path, *short_run_args, "--training.steps", "6",
                      "--optimizer.qk_clip_threshold", "0.5")  # the debug model's logits start near 0.55
    assert sorted(log.telemetry) == list(range(1, 7))
    assert all(math.isfinite(figures["max_logit"]) for figures in log.telemetry.values()), log.telemetry
    assert all(figures["qk_clipped_heads"] > 0 for figures in log.telemetry.values()), log.telemetry
    assert all(math.isfinite(loss) for loss in log.train_loss.values())
    assert log.train_loss[6] < log.train_loss[1], log.train_loss
