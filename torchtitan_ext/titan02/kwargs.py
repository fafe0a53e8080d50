"""What ``[optimizer]``'s fields make: the keyword arguments of ``dmuon.DMuon``.

TOML has no null, so three of DMuon's values have TOML spellings (``adjust_lr =
"none"``, ``split_replicas = "auto"``, ``qk_clip_threshold = 0``); they are defined
here, next to ``dmuon_kwargs``, which turns them back into DMuon's. The fields
themselves are in ``config``, their checks in ``validation``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from dmuon.numerics.update_rules import ADJUST_LR_CHOICES as DMUON_ADJUST_LR_CHOICES

from ..implementation import dmuon_implementation, IMPLEMENTATIONS_0_2

# TOML has no null, so "none" stands for DMuon's adjust_lr=None (no scaling).
ADJUST_LR_NONE = "none"
ADJUST_LR_CHOICES = tuple(ADJUST_LR_NONE if choice is None else choice for choice in DMUON_ADJUST_LR_CHOICES)
# TOML has no null: ``momentum_dtype = "param"`` is DMuon's None (the parameter's dtype).
MOMENTUM_DTYPE_PARAM = "param"
MOMENTUM_DTYPE_CHOICES = (MOMENTUM_DTYPE_PARAM, "bfloat16", "int8")
# [optimizer] split_replicas -> DMuon's split_replicas (TOML has no null either).
SPLIT_REPLICAS = {"auto": None, "always": True, "never": False}
# The network bandwidths DMuon's cost model takes (same names in TOML and in DMuon).
LINK_SPEEDS = ("link_gbps", "replica_link_gbps")


def dmuon_kwargs(optimizer_config: Any, params: Iterable[torch.Tensor] = ()) -> dict[str, Any]:
    """Map ``[optimizer]`` fields onto ``dmuon.DMuon`` keyword arguments; ``implementation``
    becomes ``foreach`` and ``fused`` (``torchtitan_ext.implementation``), ``fused`` as
    torch can fuse ``params``, the parameters the optimizer will hold.

    A spelling the TOML tables do not know is passed on as written, so that dmuon's
    validator rejects it with its own message.
    """
    cfg = optimizer_config
    kwargs = {
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "nesterov": cfg.nesterov,
        "weight_decay": cfg.weight_decay,
        "ns_steps": cfg.ns_steps,
        "ns_coefficients": cfg.ns_coefficients,
        "ns_algorithm": cfg.ns_algorithm,
        # TOML's list is DMuon's tuple; any other value goes to DMuon's validator as is.
        "ns_gram_restarts": tuple(cfg.ns_gram_restarts) if isinstance(cfg.ns_gram_restarts, list)
        else cfg.ns_gram_restarts,
        "adjust_lr": None if cfg.adjust_lr == ADJUST_LR_NONE else cfg.adjust_lr,
        "matched_adamw_rms": cfg.matched_adamw_rms,
        "adamw_lr": cfg.adamw_lr,
        "adamw_betas": (cfg.beta1, cfg.beta2),
        "adamw_eps": cfg.eps,
        "normuon": cfg.normuon,
        "normuon_beta2": cfg.normuon_beta2,
        "cautious_weight_decay": cfg.cautious_weight_decay,
        "momentum_dtype": None if cfg.momentum_dtype == MOMENTUM_DTYPE_PARAM else cfg.momentum_dtype,
        # TOML's 0 is DMuon's None (off); any other value goes to DMuon's validator as is.
        "qk_clip_threshold": None if cfg.qk_clip_threshold == 0 else cfg.qk_clip_threshold,
        "comm": cfg.comm,
        "split_replicas": SPLIT_REPLICAS.get(cfg.split_replicas, cfg.split_replicas)
        if isinstance(cfg.split_replicas, str) else cfg.split_replicas,
        "ns_dtype": cfg.ns_dtype,
        "telemetry": cfg.telemetry,
        "skip_nonfinite": cfg.skip_nonfinite,
        "capturable": cfg.capture_step,
    }
    kwargs.update({name: getattr(cfg, name) for name in LINK_SPEEDS})
    kwargs.update(dmuon_implementation(cfg.implementation, params, IMPLEMENTATIONS_0_2))
    return kwargs


def qk_clip_wanted(optimizer_config: Any) -> bool:
    """Whether the attentions must be hooked: to clip them, or only to measure logits."""
    return bool(optimizer_config.qk_clip_threshold) or optimizer_config.track_max_logits
