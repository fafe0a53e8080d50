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
* ``implementation``: ``"for-loop"`` is DMuon's ``foreach=False``, ``"foreach"`` its
  ``foreach=True``; ``"fused"`` (the default) list ops for Muon and torch's fused AdamW
  for the AdamW part where torch has it for the parameters' device (CUDA, CPU), else
  list ops (``torchtitan_ext.implementation``).

Each field's default is DMuon's (``dmuon.options.table``, as TOML spells it:
``kwargs.default_of``). What the fields make, DMuon's keyword arguments, is
``kwargs.dmuon_kwargs``; their parse-time checks are in ``validation``.
"""

# No `from __future__ import annotations` here: TorchTitan merges dataclasses by
# their real field types, which string annotations would hide.
# Choice fields are typed ``str``, not ``Literal[...]``: tyro would then reject a bad
# command-line value itself (exit 2, its own message) before dmuon's validator runs,
# and a TOML value and a command-line value would be checked by two different rules.
from dataclasses import dataclass, field


from ..routing import DEFAULT_ADAMW_PARAM_REGEX
from .kwargs import default_of

DMUON_NAME = "DMuon"

# Parameter names (as ``model.named_parameters()`` prints them; FSDP2 adds no
# prefix) that AdamW optimizes: dmuon's own default (token embeddings such as
# ``tok_embeddings``/``embed_tokens``/``wte``, output heads ``output``/``lm_head``)
# plus every norm (``attention_norm``, ``ffn_norm``, ``norm``, ``q_norm``, ...).
# Parameters with fewer than 2 dimensions go to AdamW whatever their name, since
# Newton-Schulz needs a matrix.


@dataclass
class Optimizer:
    momentum: float = default_of("momentum")
    """Muon momentum coefficient mu (EMA of gradients). 0.95 is the standard choice."""

    nesterov: bool = default_of("nesterov")
    """Use Nesterov momentum (orthogonalize g.lerp(buf, mu) instead of buf)."""

    ns_steps: int = default_of("ns_steps")
    """Newton-Schulz iterations per step. 5 is enough for the default coefficients."""

    ns_coefficients: str | list[list[float]] = default_of("ns_coefficients")
    """
    Newton-Schulz coefficients: a name from ``dmuon.NS_COEFFICIENT_SETS``
    ("keller": Keller Jordan's quintic (3.4445, -4.7750, 2.0315) in every iteration;
    "polar_express": the Polar Express schedule, a different quintic per iteration),
    or a list of [a, b, c] triples, one per iteration (the last repeats).
    """

    ns_algorithm: str = default_of("ns_algorithm")
    """
    How Newton-Schulz iterates: "standard" (torch.optim.Muon's iteration), "gram" (Gram
    Newton-Schulz on every matrix: the quintic on the m x m Gram matrix, m the smaller
    side; fp16 on GPUs) or "auto" (Gram where it costs fewer flops: aspect above 1.5,
    e.g. wk/wv and the MLP of llama3). Exact across world sizes either way.
    """

    ns_gram_restarts: list[int] = field(default_factory=lambda: default_of("ns_gram_restarts"))
    """Iterations after which Gram Newton-Schulz recomputes X and X X^T (default [2]; [] for none)."""

    ns_dtype: str = default_of("ns_dtype")
    """
    What Newton-Schulz multiplies in: "bfloat16" (what Muon is tuned for), "float32"
    (for CPUs without a native bf16 matmul, where bf16 runs ~50x slower), or "auto":
    bfloat16 on GPUs and on CPUs with native bf16 (AVX-512/AMX), float32 on other CPUs
    (AVX2). Matrices travel and results come back in bf16 either way.
    """

    adjust_lr: str = default_of("adjust_lr")
    """
    How the Muon update is scaled for an A x B matrix:
    "original" sqrt(max(1, A/B)) (Keller Jordan; use lr around 0.02),
    "match_rms_adamw" matched_adamw_rms * sqrt(max(A, B)) (Moonlight; lets Muon reuse
    an AdamW lr, around 1e-3 to 4e-3), "spectral" sqrt(A/B), or "none" (no scaling).
    """

    matched_adamw_rms: float = default_of("matched_adamw_rms")
    """Target update RMS for adjust_lr = "match_rms_adamw" (Moonlight uses 0.2)."""

    adamw_lr: float | None = default_of("adamw_lr")
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

    normuon: bool = default_of("normuon")
    """
    NorMuon (Li et al., arXiv 2510.05491): divide each row of Muon's orthogonalized
    update by the root of an EMA of its mean square, then rescale it to the update's
    Frobenius norm. Adds a per-row state (``normuon_second_moment``) to every Muon
    matrix. Off by default (plain Muon).
    """

    normuon_beta2: float = default_of("normuon_beta2")
    """The EMA coefficient of NorMuon's per-row second moment, in [0, 1). Used only with normuon = true."""

    cautious_weight_decay: bool = default_of("cautious_weight_decay")
    """
    Cautious weight decay (Chen et al., arXiv 2510.12402), for both parts: decay only
    the entries whose update and weight agree in sign. Off by default (plain decoupled
    decay, ``weight_decay`` everywhere).
    """

    momentum_dtype: str = default_of("momentum_dtype")
    """
    How Muon's momentum is kept between steps: "param" (the parameter's dtype: fp32 under
    FSDP2 mixed precision, 4 bytes an element), "bfloat16" (2 bytes), or "int8" (one fp32
    scale per 128 elements of a row: 1.03 bytes). Each step reads it back, updates it and
    rounds it again; exact across world sizes either way. With "int8", a weight whose
    layout cuts its rows off the 128-element blocks (TP with a local width that is not a
    multiple of 128) keeps bfloat16 momentum, with one log line. A checkpoint saved with
    "param" loads with "bfloat16" and back (the momentum cast); to or from "int8" the load
    fails naming the missing key: resume with the saved value.
    """

    adamw_state_dtype: str = default_of("adamw_state_dtype")
    """
    How the AdamW part (embeddings, output head) keeps its two moments between steps:
    "param" (the parameter's dtype, 8 bytes a parameter in fp32), "bfloat16" (4 bytes) or
    "int8" (the first moment, and the square root of the second, with one fp32 scale per 128
    elements of a row: 2.06 bytes). Norms and biases keep the parameter's dtype. Exact
    across world sizes; a layout that cuts rows off the blocks keeps bfloat16, as with
    momentum_dtype. A checkpoint of another value is converted on resume by DMuon's own
    load_state_dict; TorchTitan's checkpoint loads it only between "param" and "bfloat16".
    """

    qk_clip_threshold: float = default_of("qk_clip_threshold")
    """
    QK-clip (MuonClip, Kimi K2): after each step, every attention head whose largest
    pre-softmax logit in the step's forward exceeded this value gets its ``wq`` rows
    (and, without GQA, its ``wk`` rows) shrunk so that the logit would be this value.
    0 = off (TOML has no null; DMuon's None). Kimi K2 used 100. A finite number >= 0.
    Hooks every attention's ``inner_attention`` (torchtitan_ext/titan02/max_logits.py);
    refused for QK-norm (qwen3), MLA (deepseek_v3), biased wq/wk (gpt_oss), varlen
    attention and context parallelism. With telemetry, the step line shows the largest
    logit and the number of clipped heads.
    """

    track_max_logits: bool = False
    """
    Measure the attention logits as QK-clip does, without clipping (for telemetry:
    the step line's largest logit). Implied by qk_clip_threshold > 0.
    """

    comm: str = default_of("comm")
    """
    How DMuon gathers each sharded matrix to the rank that orthogonalizes it:
    "all_to_all" (batched, fast) or "redistribute" (DTensor reference path).
    """

    split_replicas: str = default_of("split_replicas")
    """
    Under HSDP (data_parallel_replicate_degree > 1): "always" spreads Newton-Schulz over
    every rank of every replica (each orthogonalizes ~1/(R*S) of the matrices; results
    cross to the other replicas), "never" keeps each replica to itself (~1/S each, no
    traffic between replicas), "auto" lets DMuon's cost model choose
    (dmuon.plan.cost_model.plan_with_best_split). No effect without replicas.
    """

    link_gbps: float = default_of("link_gbps")
    """
    Per-rank network bandwidth inside a replica, Gbit/s (one 400G NIC per GPU: 400).
    DMuon's cost model uses it to predict the step's time, e.g. for
    split_replicas = "auto". A positive number.
    """

    replica_link_gbps: float = default_of("replica_link_gbps")
    """
    Per-rank bandwidth to the ranks of other replicas (HSDP), Gbit/s: set it lower than
    link_gbps where replicas sit behind a slower tier of the network, so that
    split_replicas = "auto" weighs the traffic between replicas right. A positive number.
    """

    telemetry: bool = default_of("telemetry")
    """
    Report, on each logged step, DMuon's step time, Newton-Schulz time, bytes sent, and
    the RMS of the update and of the weights of the Muon and AdamW parts: appended to the
    console step line and sent to TensorBoard / W&B as ``dmuon/...`` metrics.
    Off by default: the step lines then stay exactly TorchTitan's (log parsers keep
    working), and the step does no extra work. On, it costs one 6-number all_reduce per
    step, a copy of one Muon block at a time, and a copy of the AdamW part's local
    shards during its update (see dmuon/step/telemetry.py).
    """

    skip_nonfinite: bool = default_of("skip_nonfinite")
    """
    Skip a step whose grads hold a NaN or inf on any rank: that step changes no weight,
    optimizer state or step count anywhere, and training goes on (DMuon(skip_nonfinite=True),
    decided on the device without a sync; docs/optimizer.md). With telemetry on, the step
    line then shows "skipped: N". Off by default: such a grad is applied, as
    torch.optim.Muon applies it.
    """

    capture_step: bool = default_of("capturable")
    """
    Capture DMuon's step in a CUDA graph after three eager warm-up steps and replay it at
    every step after (dmuon.capture.cuda_graphs): its hundreds of launches become one. Turns on
    DMuon(capturable=True): the learning rate and weight decay live on the GPU, where the LR
    scheduler writes them, so the replay follows the schedule, with the bits of an uncaptured
    step. Grads are then zeroed in place. CUDA only (refused on a CPU run); not with
    telemetry or QK-clip. Off by default. Not yet run on a GPU.
    """


@dataclass
class JobConfig:
    """The part of TorchTitan's JobConfig this extension adds (only ``[optimizer]``)."""

    optimizer: Optimizer = field(default_factory=Optimizer)
