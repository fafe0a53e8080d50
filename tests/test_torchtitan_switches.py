"""TorchTitan 0.2's training switches with DMuon, each run checked for what it promises:
``torch.compile`` (a 12-block model, with and without QK-clip), activation checkpointing
(full and selective), gradient accumulation, float8 (the 8B recipe's lines, emulated,
with FSDP float8 all-gather and precomputed scales), bf16 parameters, and
checkpoints' resume (asynchronous too).

Bitwise where the switch changes no arithmetic: activation checkpointing (it recomputes
the same forward), ``aot_eager`` compilation (the same aten ops as eager), a resume.
Close where it does: inductor fuses differently (ulp-level from step 1 on), gradient
accumulation sums the loss of two micro-batches in another order.

The in-process tests run in the default tier; the launches are the second tier
(``extended``: 10 jobs on 2 CPU ranks, 2:23 on the 2-core VM; docs/torchtitan.md,
"Training switches"), their records written by ``tests/titan_hooks/step_probe.py``
(``tests/titan_switches.py`` reads them).
"""

from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from tests.titan_switches import FLOAT8_LINE, recipe_on_cpu, recipe_with_float8, relative_gaps, switch_run

DEEP = ("--model.flavor", "debugmodel_deep")  # 12 blocks: more than Dynamo's recompile limit of 8
QK_CLIP = ("--optimizer.qk_clip_threshold", "0.5")  # the debug model's logits start near 0.55: heads clip
STEPS = 3
COMPILE = ("--compile.enable",)
# Inductor compiles C++ on CPU; a machine without a compiler can still run aot_eager.
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="inductor needs a C++ compiler on CPU")
# Inductor's fused kernels round differently from eager: the gaps measured over these 3
# steps were 5e-7 (loss) and 7e-4 (max logits, relative), 5e-7 at step 1 (the same weights).
INDUCTOR_LOSS_RTOL = 1e-5
INDUCTOR_STEP1_LOGIT_RTOL = 1e-5
INDUCTOR_LOGIT_RTOL = 1e-2
# Two micro-batches sum the loss in another order than one batch of both: 1.2e-7 measured.
ACCUMULATION_LOSS_RTOL = 1e-5


# ----------------------------------------------------------------- in-process: the compile fix


def _deep_llama(n_layers: int = 12):
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(dim=64, n_layers=n_layers, n_heads=4, vocab_size=128, max_seq_len=32))
    with torch.no_grad():
        model.init_weights()
    return model


def _train(model, *args: str, steps: int = 2) -> tuple[list[dict[str, torch.Tensor]], nn.Module]:
    """``steps`` DMuon steps of ``model`` (built as TorchTitan builds it); each step's max logits."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    import torchtitan_ext.titan02.job  # noqa: F401  (registers the DMuon-aware train specs)

    config = ConfigManager().parse_args(["--job.custom_config_module", "torchtitan_ext", "--experimental.custom_import",
                                         "torchtitan_ext.titan02.job", "--optimizer.name", "DMuon", *args])
    container = get_train_spec("llama3").build_optimizers_fn([model], config.optimizer, None)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    maxima = []
    for _ in range(steps):
        container.zero_grad()
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        container.step()
        (optimizer,) = container.optimizers
        maxima.append(optimizer.last_max_logits())
    return maxima, model


@pytest.mark.unit
def test_a_12_block_model_compiled_per_block_with_qk_clip_keeps_one_graph_and_the_eager_bits():
    """TorchTitan's per-block ``fullgraph=True`` compile, the hooks installed after it (as
    the Trainer does): one compiled version of the block serves all 12 (before the fix,
    each attention's name recompiled it and the 9th failed), and with ``aot_eager`` (the
    eager aten ops) the max logits, the clip and the weights are the eager run's bits."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torchtitan.models.llama3.infra.parallelize import apply_compile
    from torchtitan.models.llama3.model.model import TransformerBlock

    torch._dynamo.reset()
    try:
        eager_maxima, eager = _train(_deep_llama(), "--optimizer.qk_clip_threshold", "0.05")
        compiled = _deep_llama()
        apply_compile(compiled, SimpleNamespace(backend="aot_eager"))
        compiled_maxima, compiled = _train(compiled, "--optimizer.qk_clip_threshold", "0.05")
        assert len(_debug_get_cache_entry_list(TransformerBlock.forward.__code__)) == 1
    finally:
        torch._dynamo.reset()
    for eager_step, compiled_step in zip(eager_maxima, compiled_maxima, strict=True):
        assert len(eager_step) == 12 and compiled_step.keys() == eager_step.keys()  # layers.<i>.attention
        for name, maxima in compiled_step.items():
            assert torch.equal(maxima, eager_step[name]), name
    assert (eager_maxima[0]["layers.0.attention"] > 0.05).any()  # the threshold clips: the weights below moved
    eager_weights = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        assert torch.equal(param, eager_weights[name.replace("._orig_mod", "")]), name


@pytest.mark.unit
def test_the_8b_recipes_float8_line_names_a_converter_torchtitan_registers(tmp_path):
    """Uncommented, the line must name a registered converter: ``"float8"`` was a KeyError
    at job start on 0.2.x (registered as ``quantize.linear.float8``)."""
    import torchtitan.components.quantization.float8  # noqa: F401  (registers the converters)
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    import torchtitan_ext.titan02.job  # noqa: F401

    config = ConfigManager().parse_args(["--job.config_file", str(recipe_with_float8(tmp_path))])
    assert config.model.converters == [FLOAT8_LINE.split('"')[1]]
    assert all(name in _registry_model_converter_cls for name in config.model.converters)
    assert config.quantize.linear.float8.enable_fsdp_float8_all_gather
    assert config.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp


# ----------------------------------------------------------------- torchrun: compile at depth


@pytest.fixture(scope="module")
def deep_eager(short_run_args, tmp_path_factory):
    """The 12-block debug model, eager, QK-clip clipping from step 1: the reference."""
    from tests.titan_runs import DMUON_TOML

    return switch_run(DMUON_TOML, tmp_path_factory.mktemp("deep_eager"), *short_run_args, "--training.steps",
                      str(STEPS), *DEEP, *QK_CLIP)


@pytest.mark.torchrun
@pytest.mark.extended
@needs_cxx
def test_inductor_with_qk_clip_and_selective_ac_compiles_the_block_once_and_trains_as_eager(
        deep_eager, short_run_args, tmp_path):
    from tests.titan_runs import DMUON_TOML

    run = switch_run(DMUON_TOML, tmp_path, *short_run_args, "--training.steps", str(STEPS), *DEEP, *QK_CLIP,
                     *COMPILE, "--activation_checkpoint.mode", "selective",
                     "--activation_checkpoint.selective_ac_option", "op")
    for rank in run.records:
        assert [(r["compiled_block_forwards"], r["block_recompiles"], r["graph_breaks"]) for r in rank] == [
            (1, 0, 0)] * STEPS
    eager, compiled = deep_eager.steps(), run.steps()
    for step in range(1, STEPS + 1):
        assert math.isclose(compiled[step]["loss"], eager[step]["loss"], rel_tol=INDUCTOR_LOSS_RTOL), step
        assert len(compiled[step]["max_logits"]) == 12
        rtol = INDUCTOR_STEP1_LOGIT_RTOL if step == 1 else INDUCTOR_LOGIT_RTOL
        assert relative_gaps(compiled[step]["max_logits"], eager[step]["max_logits"]) <= rtol, step
        assert run.log.telemetry[step]["qk_clipped_heads"] > 0
    assert run.log.telemetry[1]["qk_clipped_heads"] == deep_eager.log.telemetry[1]["qk_clipped_heads"]


@pytest.mark.torchrun
@pytest.mark.extended
def test_aot_eager_with_qk_clip_and_full_ac_is_bitwise_the_eager_run(deep_eager, short_run_args, tmp_path):
    """``aot_eager`` traces and runs the eager aten ops, and full activation checkpointing
    recomputes the same forward: the losses, every head's max logit and every rank's
    weights are the eager run's bits."""
    from tests.titan_runs import DMUON_TOML

    run = switch_run(DMUON_TOML, tmp_path, *short_run_args, "--training.steps", str(STEPS), *DEEP, *QK_CLIP,
                     *COMPILE, "--compile.backend", "aot_eager", "--activation_checkpoint.mode", "full")
    assert [(r["compiled_block_forwards"], r["block_recompiles"]) for r in run.records[0]] == [(1, 0)] * STEPS
    assert run.losses() == deep_eager.losses()
    assert {s: r["max_logits"] for s, r in run.steps().items()} == {
        s: r["max_logits"] for s, r in deep_eager.steps().items()}
    assert run.digests() == deep_eager.digests()


@pytest.mark.torchrun
@pytest.mark.extended
@needs_cxx
def test_inductor_without_qk_clip_compiles_the_12_blocks_once(deep_eager, short_run_args, tmp_path):
    from tests.titan_runs import DMUON_TOML

    run = switch_run(DMUON_TOML, tmp_path, *short_run_args, "--training.steps", str(STEPS), *DEEP, *COMPILE)
    for rank in run.records:
        assert [(r["compiled_block_forwards"], r["block_recompiles"], r["graph_breaks"], r["max_logits"])
                for r in rank] == [(1, 0, 0, {})] * STEPS
    losses = run.losses()
    # Step 1 runs the same weights as the QK-clip reference (the clip acts after its update).
    assert math.isclose(losses[1], deep_eager.losses()[1], rel_tol=INDUCTOR_LOSS_RTOL)
    assert losses[STEPS] < losses[1]


# ----------------------------------------------------------------- torchrun: gradient accumulation


@pytest.mark.torchrun
@pytest.mark.extended
def test_two_accumulated_micro_batches_train_as_one_batch_of_both(short_run_args, tmp_path):
    """``global_batch_size`` 8 on 2 ranks of ``local_batch_size`` 2: two micro-batches a
    step, against one ``local_batch_size`` 4 batch of the same sequences. The sums differ
    in order only: close, not bitwise (step 1's loss happens to be bitwise)."""
    from tests.titan_runs import DMUON_TOML

    args = (*short_run_args, "--training.steps", str(STEPS))
    accumulated = switch_run(DMUON_TOML, tmp_path / "accumulated", *args, "--training.global_batch_size", "8")
    one_batch = switch_run(DMUON_TOML, tmp_path / "one_batch", *args, "--training.local_batch_size", "4")
    assert "gradient accumulation steps 2" in accumulated.out and "gradient accumulation steps 1" in one_batch.out
    for step, loss in one_batch.losses().items():
        assert math.isclose(accumulated.losses()[step], loss, rel_tol=ACCUMULATION_LOSS_RTOL), step
    assert accumulated.losses()[STEPS] < accumulated.losses()[1]


# ----------------------------------------------------------------- torchrun: float8, bf16, resume

RECIPE_STEPS = 4


def _recipe_and_resume(toml, folder, resume_folder, args):
    """A run of ``toml`` with a checkpoint at step 2, and its resume from that checkpoint."""
    from tests.titan_runs import copy_checkpoint

    full = switch_run(toml, folder, *args)
    copy_checkpoint(folder, 2, resume_folder)
    return full, switch_run(toml, resume_folder, *args)


def _assert_resumed_bit_for_bit(full, resumed):
    assert "Loading the checkpoint" in resumed.out and "step-2" in resumed.out
    assert sorted(resumed.losses()) == [3, 4]
    assert resumed.losses() == {s: full.losses()[s] for s in (3, 4)}
    assert resumed.digests() == [{s: d[s] for s in (3, 4)} for d in full.digests()]


@pytest.fixture(scope="module")
def float8_recipe(tokenizer_dir, tmp_path_factory):
    """The 8B recipe, float8 line uncommented, on the debug model: float8 linears
    (emulated), FSDP float8 all-gather, precomputed scales, bf16 parameters, selective
    AC, a checkpoint at step 2; then its resume from there. (The recipe sets no seed: each
    launch starts from other weights, so only a resume can be compared with its run.)"""
    folder = tmp_path_factory.mktemp("float8_recipe")
    args = (*recipe_on_cpu(tokenizer_dir, RECIPE_STEPS), "--checkpoint.interval", "2")
    return _recipe_and_resume(recipe_with_float8(folder), folder / "run", folder / "resumed", args)


@pytest.mark.torchrun
@pytest.mark.extended
def test_the_8b_recipes_float8_lines_train_with_every_muon_weight_float8_and_its_scale_current(float8_recipe):
    run, _ = float8_recipe
    assert "Swapped to Float8Linear layers with enable_fsdp_float8_all_gather=True" in run.out
    for rank in run.records:
        for record in rank:
            assert record["muon_weights"] == 42, record  # 6 blocks x (wq, wk, wv, wo, w1, w2, w3)
            assert record["muon_local_types"] == ["WeightWithDynamicFloat8CastTensor"], record
            # Each scale is the one torchao would compute from the weight DMuon just updated.
            assert record["float8_scales_current"] == 42, record
            # bf16 parameters: FSDP computes in bf16, DMuon updates the fp32 shards.
            assert record["param_dtypes"] == ["torch.float32"], record
        assert len({record["digest"] for record in rank}) == RECIPE_STEPS  # every step moved the weights
    assert all(math.isfinite(loss) for loss in run.losses().values())


@pytest.mark.torchrun
@pytest.mark.extended
def test_the_float8_runs_checkpoint_resumes_bit_for_bit_with_its_scales(float8_recipe):
    full, resumed = float8_recipe
    _assert_resumed_bit_for_bit(full, resumed)
    assert all(r["float8_scales_current"] == 42 for rank in resumed.records for r in rank)


@pytest.mark.torchrun
@pytest.mark.extended
def test_an_async_checkpoint_of_the_8b_recipe_in_bf16_resumes_bit_for_bit(tokenizer_dir, tmp_path):
    """The recipe as it ships (bf16 parameters, selective AC), its checkpoint asynchronous."""
    from tests.titan_switches import RECIPE_8B

    args = (*recipe_on_cpu(tokenizer_dir, RECIPE_STEPS), "--checkpoint.interval", "2",
            "--checkpoint.async_mode", "async")
    full, resumed = _recipe_and_resume(RECIPE_8B, tmp_path / "run", tmp_path / "resumed", args)
    assert all(r["param_dtypes"] == ["torch.float32"] for r in full.records[0])
    _assert_resumed_bit_for_bit(full, resumed)


@pytest.mark.unit
def test_an_async_checkpoint_of_fsdp_float8_weights_is_refused_at_parse_time(tmp_path):
    """torch's async stager copies torchao's float8 weight wrapper as uninitialized memory
    (a resume then trains on NaN, AdamW too): refused while parsing. Synchronous, or
    without FSDP float8 all-gather (plain weights), it parses."""
    from torchtitan.config import ConfigManager

    import torchtitan_ext.titan02.job  # noqa: F401

    toml = str(recipe_with_float8(tmp_path))
    for mode in ("async", "async_with_pinned_mem"):
        with pytest.raises(ValueError, match=rf'async_mode = "{mode}" with float8 weights all-gathered by FSDP'):
            ConfigManager().parse_args(["--job.config_file", toml, "--checkpoint.async_mode", mode])
    ConfigManager().parse_args(["--job.config_file", toml])
    ConfigManager().parse_args(["--job.config_file", toml, "--checkpoint.async_mode", "async",
                                "--quantize.linear.float8.no-enable_fsdp_float8_all_gather"])
