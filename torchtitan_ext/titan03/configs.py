"""TorchTitan 0.3 config functions for DMuon (``--module torchtitan_ext.titan03.configs``).

    torchrun --standalone --nproc-per-node 2 -m torchtitan.train \\
        --module torchtitan_ext.titan03.configs --config llama3_debug_cpu

* ``llama3_debug_cpu``: the CPU demo (llama3 debug model, ~6M parameters, 2 gloo ranks,
  FSDP2, DMuon, the embedded corpus), the 0.3 twin of
  ``train_configs/llama3_debug_dmuon.toml``; ``llama3_debug_cpu_adamw`` is the same run
  with AdamW for comparison; ``llama3_debug_cpu_qk_clip`` the DMuon run with QK-clip.
* ``llama3_8b_dmuon``: Llama 3 8B with DMuon on GPUs, the twin of
  ``train_configs/llama3_8b_dmuon.toml`` (c4 from the hub; needs GPUs and network);
  ``llama3_8b_dmuon_float8`` the same with float8 linears (``float8_linears``: the twin of
  the TOML's float8 line; SM89+ GPUs, torchao).

Calling a config function has no side effects (it only builds dataclasses): the CPU
layer is installed by ``CpuTrainer`` when the job starts, and only without an
accelerator; on a GPU machine the debug configs use TorchTitan's own FlexAttention.
Command-line flags override any field, e.g. ``--training.steps 50``.
"""

from __future__ import annotations

import copy

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer, OptimizersContainer
from torchtitan.components.quantization.float8 import Float8LinearConverter
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.profiler import Profiler
from torchtitan.trainer import Trainer

from .cpu_attention import has_accelerator, use_cpu_attention
from .cpu_compat import wrap_parallelize_fn
from .cpu_trainer import CpuTrainer
from .data import PydocDataLoader, PydocTokenizer, TRAIN_DATASET, VALIDATION_DATASET
from .metrics import DMuonMetricsProcessor
from .optimizer import dmuon_optimizer

# --- the CPU demo, as in train_configs/llama3_debug_dmuon.toml ---------------------
DEBUG_FLAVOR = "debugmodel"                     # dim 256, 6 layers, 16 heads, vocab 2048
DEBUG_ASSETS = "./outputs/assets/pydoc_tokenizer"  # corpus BPE, trained on first use
DEBUG_STEPS = 200                               # 200 x 2 ranks x 512 tokens: ~0.55 epoch
DEBUG_BATCH = 2                                 # sequences per rank per step
DEBUG_SEQ_LEN = 256
DEBUG_WARMUP = 20
DEBUG_MIN_LR_FACTOR = 0.1                       # cosine decay to 0.1 x lr
DEBUG_DMUON_LR = 0.02                           # Muon peak lr ("original" scaling)
DEBUG_ADAMW_LR = 2e-3                           # AdamW lr (DMuon's AdamW part and the baseline)
WEIGHT_DECAY = 0.1
VALIDATION_FREQ = 20
VALIDATION_STEPS = 4                            # the same 4 held-out batches each pass
SEED = 42                                       # same initial weights for DMuon and AdamW
LOG_FREQ = 10
DEBUG_QK_CLIP_THRESHOLD = 30.0                  # QK-clip's tau (Kimi K2 used 100 at scale)

# --- 8B on GPUs, as in train_configs/llama3_8b_dmuon.toml -------------------------
LLAMA3_8B_ASSETS = "./assets/hf/Llama-3.1-8B"
LLAMA3_8B_LR = 3e-4
LLAMA3_8B_COMPILE = CompileConfig(enable=False, components=["model", "loss"])
FLOAT8_SKIPPED = ["lm_head"]                   # the output head is not converted (0.2.x: filter_fqns = ["output"])


def cpu_ready(model_spec: ModelSpec) -> ModelSpec:
    """``model_spec`` made trainable on CPU when there is no accelerator (in place).

    Its attention becomes ``CpuBlockCausalAttention`` and its parallelize function
    reduces gradients with a gloo-compatible SUM; with an accelerator nothing changes.
    """
    if not has_accelerator():
        use_cpu_attention(model_spec.model)
        model_spec.parallelize_fn = wrap_parallelize_fn(model_spec.parallelize_fn)
    return model_spec


def _debug_optimizer_dmuon() -> OptimizersContainer.Config:
    return dmuon_optimizer(
        lr=DEBUG_DMUON_LR, adamw_lr=DEBUG_ADAMW_LR, weight_decay=WEIGHT_DECAY,
        factory_options={"telemetry": True},
    )


def _debug_optimizer_dmuon_qk_clip() -> OptimizersContainer.Config:
    return dmuon_optimizer(
        lr=DEBUG_DMUON_LR, adamw_lr=DEBUG_ADAMW_LR, weight_decay=WEIGHT_DECAY,
        qk_clip_threshold=DEBUG_QK_CLIP_THRESHOLD, factory_options={"telemetry": True},
    )


def _debug_optimizer_adamw() -> OptimizersContainer.Config:
    return default_adamw(lr=DEBUG_ADAMW_LR, weight_decay=WEIGHT_DECAY)


def _llama3_debug_cpu(optimizer: OptimizersContainer.Config, name: str) -> CpuTrainer.Config:
    model_spec = cpu_ready(model_registry(DEBUG_FLAVOR))
    return CpuTrainer.Config(
        dump_folder=f"./outputs/titan03_{name}",
        hf_assets_path=DEBUG_ASSETS,
        model_spec=model_spec,
        tokenizer=PydocTokenizer.Config(),
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=DEBUG_WARMUP, decay_type="cosine", min_lr_factor=DEBUG_MIN_LR_FACTOR),
        training=TrainingConfig(
            local_batch_size=DEBUG_BATCH, seq_len=DEBUG_SEQ_LEN, steps=DEBUG_STEPS,
            max_norm=1.0, mixed_precision_param="float32"),  # CPUs have slow bf16 matmuls
        dataloader=PydocDataLoader.Config(dataset=TRAIN_DATASET),
        metrics=DMuonMetricsProcessor.Config(log_freq=LOG_FREQ, disable_color_printing=True),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),  # FSDP2 over all ranks
        checkpoint=CheckpointManager.Config(enable=False, interval=100, last_save_model_only=False),
        activation_checkpoint=None,  # small model: no recomputation
        compile=CompileConfig(enable=False),  # minutes of CPU compile time
        validator=Validator.Config(
            enable=True, freq=VALIDATION_FREQ, steps=VALIDATION_STEPS,
            dataloader=PydocDataLoader.Config(dataset=VALIDATION_DATASET)),
        debug=DebugConfig(seed=SEED),
    )


def llama3_debug_cpu() -> CpuTrainer.Config:
    """The CPU demo: llama3 debug model, DMuon, 2 gloo ranks, embedded corpus."""
    return _llama3_debug_cpu(_debug_optimizer_dmuon(), "llama3_debug_dmuon")


def llama3_debug_cpu_qk_clip() -> CpuTrainer.Config:
    """``llama3_debug_cpu`` with QK-clip (MuonClip): after each step, heads whose largest
    attention logit exceeded the threshold get their ``wqkv`` rows scaled; the step line
    shows ``max_logit`` and ``qk_clipped``. Change the threshold with
    ``--optimizer.param_groups.0.optimizer_kwargs.qk_clip_threshold 10``."""
    return _llama3_debug_cpu(_debug_optimizer_dmuon_qk_clip(), "llama3_debug_dmuon_qk_clip")


def llama3_debug_cpu_adamw() -> CpuTrainer.Config:
    """``llama3_debug_cpu`` with AdamW (lr 2e-3, weight decay 0.1): the baseline."""
    return _llama3_debug_cpu(_debug_optimizer_adamw(), "llama3_debug_adamw")


def float8_linears(compile_config: CompileConfig, emulate: bool = False) -> list[Float8LinearConverter.Config]:
    """The converters of a float8 model (``model_registry(flavor, converters=...)``), the
    0.3.x twin of the 0.2.x TOML's ``converters = ["quantize.linear.float8"]``: every
    Linear but the output head in float8, TorchTitan's default rowwise recipe. 0.3.0 has
    no FSDP float8 all-gather or precomputed scales (0.2.x's tensorwise options). TorchTitan
    builds the converter when the config function runs: without an SM89+ GPU it raises,
    unless ``emulate`` (tests only; not with ``torch.compile``)."""
    return [Float8LinearConverter.Config(
        filter_fqns=list(FLOAT8_SKIPPED), emulate=emulate,
        model_compile_enabled=compile_config.enable and "model" in compile_config.components)]


def llama3_8b_dmuon() -> Trainer.Config:
    """Llama 3 8B with DMuon on GPUs: TorchTitan's ``llama3_8b`` recipe, DMuon instead of
    AdamW with the 8B TOML's options (shared lr 3e-4, ``match_rms_adamw`` scaling)."""
    return _llama3_8b_dmuon(model_registry("8B"))


def llama3_8b_dmuon_float8() -> Trainer.Config:
    """``llama3_8b_dmuon`` with float8 linears (``float8_linears``; needs an SM89+ GPU and
    torchao: TorchTitan refuses float8 elsewhere when this function runs)."""
    return _llama3_8b_dmuon(model_registry("8B", converters=float8_linears(LLAMA3_8B_COMPILE)))


def _llama3_8b_dmuon(model_spec: ModelSpec) -> Trainer.Config:
    return Trainer.Config(
        dump_folder="./outputs/titan03_llama3_8b_dmuon",
        hf_assets_path=LLAMA3_8B_ASSETS,
        model_spec=model_spec,
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))),
        profiler=Profiler.Config(enable_profiling=True, profile_freq=100),
        metrics=DMuonMetricsProcessor.Config(enable_tensorboard=True),
        optimizer=dmuon_optimizer(
            lr=LLAMA3_8B_LR, weight_decay=WEIGHT_DECAY, adjust_lr="match_rms_adamw",
            matched_adamw_rms=0.2),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=200, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(
            local_batch_size=1, seq_len=8192, steps=1000, max_norm=1.0,
            mixed_precision_param="bfloat16", mixed_precision_reduce="float32"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        checkpoint=CheckpointManager.Config(
            enable=True, interval=500, last_save_model_only=True, export_dtype="float32"),
        activation_checkpoint=SelectiveAC.Config(),
        compile=copy.deepcopy(LLAMA3_8B_COMPILE),
        validator=Validator.Config(freq=500, steps=1200),
    )


__all__ = [
    "cpu_ready",
    "float8_linears",
    "llama3_8b_dmuon",
    "llama3_8b_dmuon_float8",
    "llama3_debug_cpu",
    "llama3_debug_cpu_adamw",
    "llama3_debug_cpu_qk_clip",
]
