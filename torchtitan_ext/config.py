"""``[optimizer]`` fields for DMuon, merged into TorchTitan's JobConfig.

TorchTitan 0.2.x imports ``[job] custom_config_module`` while it parses the
config and merges that module's ``JobConfig`` dataclass into its own, field by
field. So the ``Optimizer`` dataclass below *adds* keys to ``[optimizer]``; the
stock keys keep their TorchTitan meaning:

* ``name``: ``"DMuon"`` selects this project's optimizer; ``"Adam"``/``"AdamW"``
  build exactly what TorchTitan builds (all DMuon keys are then ignored).
* ``lr``: the Muon learning rate (for matrices); also the AdamW learning rate
  unless ``adamw_lr`` is set.
* ``beta1``, ``beta2``, ``eps``: AdamW's betas and epsilon, used for the
  parameters routed to AdamW (embeddings, output head, norms, biases).
* ``weight_decay``: decoupled weight decay for both parts.
* ``implementation``: applies to Adam/AdamW only.

``validate_optimizer_config`` rejects bad values with an error naming the TOML
key; ``install_config_validation`` makes TorchTitan's ``ConfigManager`` call it
right after parsing, i.e. before any process group or model exists.
"""

# No `from __future__ import annotations` here: TorchTitan merges dataclasses by
# their real field types, which string annotations would hide.
import functools
import re
from dataclasses import dataclass, field
from typing import Any

from dmuon import ADJUST_LR_CHOICES as _DMUON_ADJUST_LR_CHOICES
from dmuon import DEFAULT_ADAMW_NAME_PATTERN, NS_COEFFICIENT_SETS
from dmuon.newton_schulz import DEFAULT_NS_DTYPE
from dmuon.param_groups import check_ns_dtype, resolve_ns_coefficients

DMUON_NAME = "DMuon"

# TOML has no null, so "none" stands for DMuon's adjust_lr=None (no scaling).
ADJUST_LR_CHOICES = tuple("none" if c is None else c for c in _DMUON_ADJUST_LR_CHOICES)

# Parameter names (as ``model.named_parameters()`` prints them; FSDP2 adds no
# prefix) that AdamW optimizes: dmuon's own default (token embeddings such as
# ``tok_embeddings``/``embed_tokens``/``wte``, output heads ``output``/``lm_head``)
# plus every norm (``attention_norm``, ``ffn_norm``, ``norm``, ``q_norm``, ...).
# Parameters with fewer than 2 dimensions go to AdamW whatever their name, since
# Newton-Schulz needs a matrix.
DEFAULT_ADAMW_PARAM_REGEX = DEFAULT_ADAMW_NAME_PATTERN + "|norm"


@dataclass
class Optimizer:
    momentum: float = 0.95
    """Muon momentum coefficient mu (EMA of gradients). 0.95 is the standard choice."""

    nesterov: bool = True
    """Use Nesterov momentum (orthogonalize g.lerp(buf, mu) instead of buf)."""

    ns_steps: int = 5
    """Newton-Schulz iterations per step. 5 is enough for the default coefficients."""

    ns_coefficients: str | list[list[float]] = "keller"
    """
    Newton-Schulz coefficients: a name from ``dmuon.NS_COEFFICIENT_SETS``
    ("keller": Keller Jordan's quintic (3.4445, -4.7750, 2.0315) in every iteration;
    "polar_express": the Polar Express schedule, a different quintic per iteration),
    or a list of [a, b, c] triples, one per iteration (the last repeats).
    """

    ns_dtype: str = DEFAULT_NS_DTYPE
    """
    What Newton-Schulz multiplies in: "bfloat16" (what Muon is tuned for), "float32"
    (for CPUs without a native bf16 matmul, where bf16 runs ~50x slower), or "auto":
    bfloat16 on GPUs and on CPUs with native bf16 (AVX-512/AMX), float32 on other CPUs
    (AVX2). Matrices travel and results come back in bf16 either way.
    """

    adjust_lr: str = "original"
    """
    How the Muon update is scaled for an A x B matrix:
    "original" sqrt(max(1, A/B)) (Keller Jordan; use lr around 0.02),
    "match_rms_adamw" matched_adamw_rms * sqrt(max(A, B)) (Moonlight; lets Muon reuse
    an AdamW lr, around 1e-3 to 4e-3), "spectral" sqrt(A/B), or "none" (no scaling).
    """

    matched_adamw_rms: float = 0.2
    """Target update RMS for adjust_lr = "match_rms_adamw" (Moonlight uses 0.2)."""

    adamw_lr: float | None = None
    """
    Learning rate of the AdamW part (embeddings, output head, norms, biases).
    Leave unset to use ``lr`` for both parts (right with "match_rms_adamw").
    """

    adamw_param_regex: str = DEFAULT_ADAMW_PARAM_REGEX
    """
    Python regular expression, searched (re.search) in each parameter's name; matching
    parameters are optimized by AdamW, the others by Muon. Parameters with fewer than
    two dimensions always go to AdamW. Default: embeddings, output head and norms.
    """

    split_attention_heads: bool = False
    """
    Orthogonalize each attention head's rows of ``wq``, ``wk`` and ``wv`` on its own
    (DMuon ``split_rows``), with the head size read from the model: it applies to the
    weights named ``wq``/``wk``/``wv`` of every module that has a ``head_dim`` attribute
    (the attention of llama3, llama4 and qwen3). They get a Muon group of their own.
    ``wo`` and models without such modules (deepseek_v3's MLA) are unaffected.
    """

    comm: str = "all_to_all"
    """
    How DMuon gathers each sharded matrix to the rank that orthogonalizes it:
    "all_to_all" (batched, fast) or "redistribute" (DTensor reference path).
    """

    split_replicas: str = "auto"
    """
    Under HSDP (data_parallel_replicate_degree > 1): "always" spreads Newton-Schulz over
    every rank of every replica (each orthogonalizes ~1/(R*S) of the matrices; results
    cross to the other replicas), "never" keeps each replica to itself (~1/S each, no
    traffic between replicas), "auto" lets DMuon's cost model choose
    (dmuon.cost_model.plan_with_best_split). No effect without replicas.
    """

    telemetry: bool = False
    """
    Report, on each logged step, DMuon's step time, Newton-Schulz time, bytes sent, and
    the RMS of the update and of the weights of the Muon and AdamW parts: appended to the
    console step line and sent to TensorBoard / W&B as ``dmuon/...`` metrics.
    Off by default: the step lines then stay exactly TorchTitan's (log parsers keep
    working), and the step does no extra work. On, it costs one 6-number all_reduce per
    step, a copy of one Muon block at a time, and a copy of the AdamW part's local
    shards during its update (see dmuon/telemetry.py).
    """


@dataclass
class JobConfig:
    """The part of TorchTitan's JobConfig this extension adds (only ``[optimizer]``)."""

    optimizer: Optimizer = field(default_factory=Optimizer)


def validate_optimizer_config(optimizer_config: Any) -> None:
    """Raise ``ValueError`` naming the TOML key if a DMuon setting cannot work.

    Only checks anything when ``[optimizer] name = "DMuon"``.
    """
    cfg = optimizer_config
    if cfg.name != DMUON_NAME:
        return
    if cfg.early_step_in_backward:
        raise ValueError(
            "[optimizer] early_step_in_backward = true is not supported with "
            f'name = "{DMUON_NAME}": Muon orthogonalizes whole matrices after the '
            "backward pass (and gradient clipping), not one parameter inside it. "
            "Set early_step_in_backward = false."
        )
    if cfg.adjust_lr not in ADJUST_LR_CHOICES:
        raise ValueError(
            f"[optimizer] adjust_lr = {cfg.adjust_lr!r} is not known. "
            f"Use one of {', '.join(repr(c) for c in ADJUST_LR_CHOICES)}."
        )
    try:
        re.compile(cfg.adamw_param_regex)
    except (re.error, TypeError) as e:
        raise ValueError(
            f"[optimizer] adamw_param_regex = {cfg.adamw_param_regex!r} is not a valid "
            f"Python regular expression ({e}). In TOML, write it as a literal string in "
            "single quotes so backslashes stay as typed."
        ) from e
    try:
        resolve_ns_coefficients(cfg.ns_coefficients)
    except ValueError:
        known_sets = ", ".join(repr(c) for c in NS_COEFFICIENT_SETS)
        raise ValueError(
            f"[optimizer] ns_coefficients = {cfg.ns_coefficients!r} is not known. "
            f"Use one of {known_sets}, or a list of [a, b, c] triples (one per iteration)."
        ) from None
    check_ns_dtype(cfg.ns_dtype, "[optimizer]")
    if cfg.ns_steps < 1:
        raise ValueError(f"[optimizer] ns_steps = {cfg.ns_steps} must be at least 1.")
    if not 0.0 <= cfg.momentum < 1.0:
        raise ValueError(f"[optimizer] momentum = {cfg.momentum} must be in [0, 1).")
    if cfg.comm not in ("all_to_all", "redistribute"):
        raise ValueError(
            f"[optimizer] comm = {cfg.comm!r} is not known. Use 'all_to_all' or 'redistribute'."
        )
    if cfg.split_replicas not in ("auto", "always", "never"):
        raise ValueError(
            f"[optimizer] split_replicas = {cfg.split_replicas!r} is not known. Use 'auto', 'always' or 'never'."
        )


def install_config_validation() -> None:
    """Run ``validate_optimizer_config`` whenever TorchTitan validates a parsed config.

    TorchTitan merges our dataclass fields into a new class based on its own, so a
    ``__post_init__`` here would never run; hooking ``ConfigManager._validate_config``
    is the one place that sees every parsed config (TOML and command line).
    """
    from torchtitan.config.manager import ConfigManager

    original = ConfigManager._validate_config
    if getattr(original, "_dmuon_validation", False):
        return

    @functools.wraps(original)
    def validate_config(self) -> None:
        original(self)
        validate_optimizer_config(self.config.optimizer)

    validate_config._dmuon_validation = True  # type: ignore[attr-defined]
    ConfigManager._validate_config = validate_config
