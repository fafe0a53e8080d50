"""What ``[optimizer]``'s fields make: the keyword arguments of ``dmuon.DMuon``.

Each DMuon option's field is its row of ``dmuon.options.table`` (``titan02``). TOML has no
null, so five of DMuon's values have TOML spellings (``adjust_lr = "none"``,
``momentum_dtype = "param"``, ``adamw_state_dtype = "param"``, ``split_replicas = "auto"``, ``qk_clip_threshold = 0``); they
are defined here, next to ``dmuon_kwargs``, which turns them back into DMuon's. The fields
themselves are in ``config``, their checks in ``validation``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from dmuon import ADJUST_LR_CHOICES as DMUON_ADJUST_LR_CHOICES, NS_COEFFICIENT_SETS
from dmuon.options import DEFAULTS, OPTIONS

from ..implementation import dmuon_implementation, IMPLEMENTATIONS_0_2

# TOML has no null, so "none" stands for DMuon's adjust_lr=None (no scaling).
ADJUST_LR_NONE = "none"
ADJUST_LR_CHOICES = tuple(ADJUST_LR_NONE if choice is None else choice for choice in DMUON_ADJUST_LR_CHOICES)
# TOML has no null: ``momentum_dtype = "param"`` is DMuon's None (the parameter's dtype).
MOMENTUM_DTYPE_PARAM = "param"
MOMENTUM_DTYPE_CHOICES = (MOMENTUM_DTYPE_PARAM, "bfloat16", "int8")
# [optimizer] split_replicas -> DMuon's split_replicas (TOML has no null either).
SPLIT_REPLICAS = {"auto": None, "always": True, "never": False}
# The fields TOML spells with words of their own: each spelling -> DMuon's value.
TOML_SPELLINGS: dict[str, dict[str, Any]] = {
    "adjust_lr": {ADJUST_LR_NONE: None},
    "momentum_dtype": {MOMENTUM_DTYPE_PARAM: None},
    "adamw_state_dtype": {MOMENTUM_DTYPE_PARAM: None},
    "split_replicas": SPLIT_REPLICAS,
}
# The whole list of values each spelled field takes, for messages.
TOML_CHOICES = {"adjust_lr": ADJUST_LR_CHOICES, "momentum_dtype": MOMENTUM_DTYPE_CHOICES,
                "adamw_state_dtype": MOMENTUM_DTYPE_CHOICES,
                "split_replicas": tuple(SPLIT_REPLICAS)}
# The field TorchTitan spells as two (its own AdamW betas), and the field ``implementation``
# makes two of DMuon's options of (``foreach`` and ``fused``).
BETAS, IMPLEMENTATION = "adamw_betas", "implementation"
# The options whose fields are a TorchTitan field of their own meaning (not one per option).
NOT_ONE_FIELD = (BETAS,)


def toml_value(name: str, value: Any) -> Any:
    """DMuon's value of ``name`` as the TOML field holds it (the default of a field)."""
    for spelling, meaning in TOML_SPELLINGS.get(name, {}).items():
        if value is meaning:
            return spelling
    if name == "qk_clip_threshold" and value is None:
        return 0.0  # TOML's 0 is off
    if name == "ns_coefficients":  # a named set by its name: one command-line string
        value = next((set_name for set_name, triple in NS_COEFFICIENT_SETS.items() if triple == value), value)
    return list(value) if isinstance(value, tuple) else value


def from_toml(name: str, value: Any) -> Any:
    """The field's value as DMuon takes it; a spelling the tables do not know is passed on as
    written, so that dmuon's validator rejects it with its own message."""
    if isinstance(value, str) and value in TOML_SPELLINGS.get(name, {}):
        return TOML_SPELLINGS[name][value]
    if name == "qk_clip_threshold" and value == 0:
        return None  # TOML's 0 is DMuon's None (off)
    if name == "ns_gram_restarts" and isinstance(value, list):
        return tuple(value)  # TOML's list is DMuon's tuple
    return value


def default_of(name: str) -> Any:
    """The ``[optimizer]`` field's default: DMuon's, as TOML spells it."""
    return toml_value(name, DEFAULTS[name])


def dmuon_kwargs(optimizer_config: Any, params: Iterable[torch.Tensor] = ()) -> dict[str, Any]:
    """Map ``[optimizer]`` fields onto ``dmuon.DMuon`` keyword arguments; ``implementation``
    becomes ``foreach`` and ``fused`` (``torchtitan_ext.implementation``), ``fused`` as
    torch can fuse ``params``, the parameters the optimizer will hold. An option with no field
    keeps DMuon's default."""
    cfg = optimizer_config
    kwargs = {option.name: from_toml(option.name, getattr(cfg, option.titan02)) for option in OPTIONS
              if option.titan02 not in (None, IMPLEMENTATION) and option.name not in NOT_ONE_FIELD}
    kwargs[BETAS] = (cfg.beta1, cfg.beta2)
    kwargs.update(dmuon_implementation(cfg.implementation, params, IMPLEMENTATIONS_0_2))
    return kwargs


def qk_clip_wanted(optimizer_config: Any) -> bool:
    """Whether the attentions must be hooked: to clip them, or only to measure logits."""
    return bool(optimizer_config.qk_clip_threshold) or optimizer_config.track_max_logits
