"""TorchTitan 0.3's training switches with DMuon that the 0.2.x matrix
(``tests/test_torchtitan_switches.py``) cannot speak for: ``torch.compile`` of a 12-block
model with and without QK-clip (0.3 compiles each block in place with ``fullgraph=True``,
its CPU attention and its logit hook are traced into the block's graph), and float8
linears from the config functions' ``float8_linears`` (emulated). Skipped beside 0.2.x;
CI runs them in ``scripts/test_newest_torch.sh``'s 0.3.x stage.

What 0.3.x shares with 0.2.x (activation checkpointing, gradient accumulation, DCP
checkpoints) is the same torch code under DMuon, run in the 0.2.x matrix; 0.3.0 has no
FSDP float8 all-gather to test.
"""

from __future__ import annotations

import math
import shutil

import pytest

from tests.titan03_support import require_titan03

require_titan03()

from tests.titan_switches import titan03_switch_run  # noqa: E402

STEPS = 3
QK_CLIP = ("--optimizer.param_groups.0.optimizer_kwargs.qk_clip_threshold", "0.5")  # heads clip from step 1
COMPILE = ("--compile.enable", "--compile.components", "model")
# The document count of a batch (the length of VarlenMetadata.cu_seq_q) changes between
# steps: Dynamo recompiles the block once, marking that size dynamic, whatever the depth.
DOCUMENT_COUNT_RECOMPILES = 1
INDUCTOR_LOSS_RTOL = 1e-5  # measured: 2.4e-7 over 3 steps


@pytest.fixture(scope="module")
def deep_eager(tokenizer_dir, tmp_path_factory):
    """The 12-block CPU demo, eager, QK-clip clipping from step 1: the reference."""
    return titan03_switch_run("llama3_deep_cpu_qk_clip", tmp_path_factory.mktemp("deep_eager"), tokenizer_dir,
                              *QK_CLIP, steps=STEPS)


def _assert_compiled_once(run):
    for rank in run.records:
        for record in rank:
            assert record["compiled_block_forwards"] == 1 and record["graph_breaks"] == 0, record
            assert record["block_recompiles"] <= DOCUMENT_COUNT_RECOMPILES, record


@pytest.mark.torchrun
@pytest.mark.extended
def test_aot_eager_with_qk_clip_at_12_blocks_compiles_once_and_is_bitwise_the_eager_run(
        deep_eager, tokenizer_dir, tmp_path):
    run = titan03_switch_run("llama3_deep_cpu_qk_clip", tmp_path, tokenizer_dir, *QK_CLIP, *COMPILE,
                             "--compile.backend", "aot_eager", steps=STEPS)
    _assert_compiled_once(run)
    assert run.losses() == deep_eager.losses()
    steps = run.steps()
    assert all(len(steps[s]["max_logits"]) == 12 for s in steps)
    assert {s: r["max_logits"] for s, r in steps.items()} == {s: r["max_logits"] for s, r in deep_eager.steps().items()}
    assert run.digests() == deep_eager.digests()
    assert all(run.log.telemetry[s]["qk_clipped_heads"] > 0 for s in range(1, STEPS + 1))


@pytest.mark.torchrun
@pytest.mark.extended
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor needs a C++ compiler on CPU")
def test_inductor_without_qk_clip_at_12_blocks_compiles_once(deep_eager, tokenizer_dir, tmp_path):
    run = titan03_switch_run("llama3_deep_cpu", tmp_path, tokenizer_dir, *COMPILE, steps=STEPS)
    _assert_compiled_once(run)
    assert all(r["max_logits"] == {} for r in run.records[0])
    losses = run.losses()
    # Step 1 runs the same weights as the QK-clip reference (the clip acts after its update).
    assert math.isclose(losses[1], deep_eager.losses()[1], rel_tol=INDUCTOR_LOSS_RTOL)
    assert losses[STEPS] < losses[1]


@pytest.mark.torchrun
@pytest.mark.extended
def test_float8_linears_emulated_train_with_dmuon(tokenizer_dir, tmp_path):
    """``configs.float8_linears`` (the 8B float8 recipe's converters) on the CPU demo:
    every Linear but the output head is torchao's ``Float8Linear`` (rowwise recipe,
    emulated), DMuon updates their weights, the loss falls."""
    run = titan03_switch_run("llama3_debug_cpu_float8", tmp_path, tokenizer_dir, steps=STEPS)
    assert "Swapped to Float8Linear layers" in run.out
    for rank in run.records:
        assert all(r["float8_linears"] == 30 for r in rank), rank  # 6 blocks x (wqkv, wo, w1, w2, w3)
        assert len({r["digest"] for r in rank}) == STEPS
    losses = run.losses()
    assert all(math.isfinite(loss) for loss in losses.values()) and losses[STEPS] < losses[1]


@pytest.mark.unit
def test_the_8b_float8_config_converts_every_linear_but_the_output_head(monkeypatch):
    """``llama3_8b_dmuon_float8`` as TorchTitan builds it on an SM89+ GPU (its capability
    check answered yes here; on a CPU TorchTitan refuses float8 at that point)."""
    import torchtitan.components.quantization.float8 as float8
    from torchtitan.models.common.linear import Linear

    from torchtitan_ext.titan03.configs import llama3_8b_dmuon_float8

    monkeypatch.setattr(float8, "has_cuda_capability", lambda *_: True)
    config = llama3_8b_dmuon_float8()
    linears = {fqn: type(cfg).__qualname__ for fqn, cfg, _, _ in config.model_spec.model.traverse(Linear.Config)}
    assert linears and {fqn for fqn, kind in linears.items() if "Float8" not in kind} == {"lm_head"}, linears
    assert config.optimizer.param_groups[0].optimizer_name == "DMuon"

