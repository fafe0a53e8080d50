"""Every option of DMuon, once: its default, its check, where it applies, what a resume does
with a change, its TorchTitan names, and a bad and a changed value for the tests. The
constructor's signature and validation, the group keys, the resume contract, what a pickle
keeps, TorchTitan's fields, checks and factory options and the docs' option tables are all
read from :data:`OPTIONS` (tests check each against it; docs/development.md, "A new option").
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dmuon.numerics.newton_schulz import (
    DEFAULT_GRAM_RESTARTS,
    DEFAULT_NS_ALGORITHM,
    DEFAULT_NS_DTYPE,
    DEFAULT_NS_EPS,
    DEFAULT_NS_STEPS,
    KELLER_COEFFICIENTS,
)
from dmuon.numerics.update_rules import DEFAULT_MATCHED_ADAMW_RMS, DEFAULT_NORMUON_BETA2
from dmuon.options import checks as c
from dmuon.options.implementation_flags import check_capturable, check_foreach, check_fused, check_no_path_flags
from dmuon.plan.batches import DEFAULT_BATCH_NUMEL
from dmuon.plan.cost_model import CostModel
from dmuon.plan.paths import ALL_TO_ALL


class Scope(enum.Enum):
    """Where an option applies."""

    MUON = "Muon groups"
    ADAMW = "AdamW groups"
    GROUPS = "Muon and AdamW groups"
    OPTIMIZER = "the whole optimizer"
    FLAG = "torch.optim flag: the optimizer's, and a key of any group"


class OnResume(enum.Enum):
    """What ``load_state_dict`` does when a group's saved value differs from the optimizer's
    (``dmuon.state.resume_contract``)."""

    APPLIED = "applied: the optimizer's value is kept, the change logged"
    CONVERTED = "applied: the saved state converted to the new form, the change logged"
    REFUSED = "refused (it changes the state's layout): resume with the saved value"
    NOT_SAVED = "not in the state dict: the optimizer's value"


# Where TorchTitan 0.3 takes an option: a param group's ``optimizer_kwargs`` or the whole
# optimizer's ``optimizer_factory_kwargs_by_name["DMuon"]``.
GROUP_KWARGS = "optimizer_kwargs"
FACTORY_KWARGS = "optimizer_factory_kwargs_by_name"


@dataclass(frozen=True)
class Option:
    """One option. ``key`` is its key in a group dict (``adamw_lr`` is the AdamW group's
    ``lr``); ``check(value, key, where)`` returns the value to keep or raises ``ValueError``
    naming ``where`` and the option. ``titan02``: its ``[optimizer]`` field (None: none, the
    default is used); ``titan03``: where 0.3 takes it (None: nowhere). ``bad``: a value
    ``check`` refuses; ``changed``: a legal value other than the default (the tests' and
    the option sweep's: tests/test_option_table.py, tests/option_sweep.py)."""

    name: str
    default: Any
    scope: Scope
    check: Callable[[Any, str, str], Any]
    on_resume: OnResume
    titan02: str | None
    titan03: str | None
    summary: str
    key: str = ""
    bad: Any = field(kw_only=True)
    changed: Any = field(kw_only=True)

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.name)


def _keyed(check: Callable[[Any, str], Any]) -> Callable[[Any, str, str], Any]:
    """A whole-optimizer check, ``check(value, where)``, as the table calls checks."""
    return lambda value, key, where: check(value, where)


def _no_path(value: Any, key: str, where: str) -> Any:
    check_no_path_flags({key: value}, where)
    return value


_NON_NEGATIVE = c.in_range(0.0)
_UNIT = c.in_range(0.0, 1.0, high_open=True)

# In the order a group is checked (the first bad value is the one reported).
OPTIONS: tuple[Option, ...] = (
    Option("lr", 0.02, Scope.GROUPS, _NON_NEGATIVE, OnResume.APPLIED, "lr", GROUP_KWARGS,
           "Muon's learning rate (AdamW's too unless adamw_lr); a float or a one-element Tensor",
           bad=-1.0, changed=0.01),
    Option("weight_decay", 0.0, Scope.GROUPS, _NON_NEGATIVE, OnResume.APPLIED, "weight_decay", GROUP_KWARGS,
           "decoupled decay, p *= 1 - lr * weight_decay (AdamW's too unless adamw_weight_decay)",
           bad=-0.1, changed=0.05),
    Option("momentum", 0.95, Scope.MUON, _UNIT, OnResume.APPLIED, "momentum", GROUP_KWARGS,
           "the momentum EMA's coefficient", bad=1.0, changed=0.9),
    Option("eps", DEFAULT_NS_EPS, Scope.MUON, c.in_range(0.0, low_open=True), OnResume.APPLIED, None, GROUP_KWARGS,
           "the norm floor before Newton-Schulz", bad=0.0, changed=1e-6),
    Option("matched_adamw_rms", DEFAULT_MATCHED_ADAMW_RMS, Scope.MUON, c.in_range(0.0, low_open=True),
           OnResume.APPLIED, "matched_adamw_rms", GROUP_KWARGS, "the update RMS adjust_lr='match_rms_adamw' aims at",
           bad=0.0, changed=0.3),
    Option("ns_steps", DEFAULT_NS_STEPS, Scope.MUON, c.check_ns_steps, OnResume.APPLIED, "ns_steps", GROUP_KWARGS,
           "Newton-Schulz iterations", bad=0, changed=3),
    Option("adjust_lr", "original", Scope.MUON, c.check_adjust_lr, OnResume.APPLIED, "adjust_lr", GROUP_KWARGS,
           "the shape scale: 'original', 'match_rms_adamw', 'spectral' or None", bad="sometimes", changed="spectral"),
    Option("split_rows", None, Scope.MUON, c.check_split_rows, OnResume.REFUSED, None, GROUP_KWARGS,
           "orthogonalize each block of this many rows on its own (an attention head)", bad=0, changed=4),
    Option("nesterov", True, Scope.MUON, c.check_bool, OnResume.APPLIED, "nesterov", GROUP_KWARGS,
           "Nesterov look-ahead: orthogonalize g.lerp(momentum, mu)", bad=1, changed=False),
    Option("normuon", False, Scope.MUON, c.check_bool, OnResume.REFUSED, "normuon", GROUP_KWARGS,
           "NorMuon's row-normalized update (adds the state normuon_second_moment)", bad="yes", changed=True),
    Option("normuon_beta2", DEFAULT_NORMUON_BETA2, Scope.MUON, _UNIT, OnResume.APPLIED, "normuon_beta2",
           GROUP_KWARGS, "the EMA coefficient of NorMuon's row second moment", bad=1.0, changed=0.9),
    Option("cautious_weight_decay", False, Scope.GROUPS, c.check_bool, OnResume.APPLIED, "cautious_weight_decay",
           GROUP_KWARGS, "decay only where the update and the weight agree in sign", bad=1, changed=True),
    Option("qk_clip_threshold", None, Scope.MUON, c.check_qk_clip_threshold, OnResume.APPLIED,
           "qk_clip_threshold", GROUP_KWARGS, "QK-clip's largest attention logit (None: off)", bad=-1.0, changed=50.0),
    Option("ns_algorithm", DEFAULT_NS_ALGORITHM, Scope.MUON, c.check_ns_algorithm, OnResume.APPLIED,
           "ns_algorithm", GROUP_KWARGS, "'standard', 'gram' or 'auto' (Gram Newton-Schulz where cheaper)",
           bad="fast", changed="gram"),
    Option("ns_gram_restarts", DEFAULT_GRAM_RESTARTS, Scope.MUON, c.check_gram_restarts, OnResume.APPLIED,
           "ns_gram_restarts", GROUP_KWARGS, "the iterations after which Gram Newton-Schulz restarts",
           bad=(0,), changed=()),
    Option("momentum_dtype", None, Scope.MUON, c.check_momentum_dtype, OnResume.CONVERTED, "momentum_dtype",
           GROUP_KWARGS, "the momentum kept between steps: None (the parameter's dtype), bfloat16 or int8",
           bad="fp8", changed="bfloat16"),
    Option("ns_coefficients", KELLER_COEFFICIENTS, Scope.MUON, c.check_ns_coefficients, OnResume.APPLIED,
           "ns_coefficients", GROUP_KWARGS, "a name, one (a, b, c), or one triple per iteration",
           bad="best", changed="polar_express"),
    Option("adamw_lr", None, Scope.ADAMW, c.optional(_NON_NEGATIVE), OnResume.APPLIED, "adamw_lr", GROUP_KWARGS,
           "the AdamW part's learning rate (None: lr)", key="lr", bad=-1.0, changed=1e-3),
    Option("adamw_betas", (0.9, 0.95), Scope.ADAMW, c.check_betas, OnResume.APPLIED, "beta1, beta2", GROUP_KWARGS,
           "the AdamW part's betas", key="betas", bad=(1.0, 0.9), changed=(0.8, 0.9)),
    Option("adamw_eps", 1e-8, Scope.ADAMW, _NON_NEGATIVE, OnResume.APPLIED, "eps", GROUP_KWARGS,
           "the AdamW part's epsilon", key="eps", bad=-1.0, changed=1e-6),
    Option("adamw_weight_decay", None, Scope.ADAMW, c.optional(_NON_NEGATIVE), OnResume.APPLIED, None, GROUP_KWARGS,
           "the AdamW part's decay (None: weight_decay)", key="weight_decay", bad=-1.0, changed=0.2),
    Option("adamw_state_dtype", None, Scope.ADAMW, c.check_momentum_dtype, OnResume.CONVERTED, "adamw_state_dtype",
           GROUP_KWARGS, "the AdamW moments kept between steps: None (the parameter's dtype), bfloat16 or int8 "
           "(parameters of 2+ dims)", key="state_dtype", bad="fp8", changed="int8"),
    Option("comm", ALL_TO_ALL, Scope.OPTIMIZER, _keyed(c.check_comm), OnResume.NOT_SAVED, "comm", FACTORY_KWARGS,
           "'all_to_all' (the owner-computed fast path) or 'redistribute' (every rank, every matrix)",
           bad="nccl", changed="redistribute"),
    Option("max_batch_numel", DEFAULT_BATCH_NUMEL, Scope.OPTIMIZER, _keyed(c.check_max_batch_numel), OnResume.NOT_SAVED,
           None, FACTORY_KWARGS, "matrix elements a rank owns per batch of the fast path (its scratch bound)",
           bad=0, changed=1 << 20),
    Option("split_replicas", None, Scope.OPTIMIZER, _keyed(c.check_split_replicas), OnResume.NOT_SAVED, "split_replicas",
           FACTORY_KWARGS, "under HSDP: spread Newton-Schulz over every replica (True), not (False), or ask the "
           "cost model (None)", bad="sometimes", changed=True),
    Option("ns_dtype", DEFAULT_NS_DTYPE, Scope.OPTIMIZER, _keyed(c.check_ns_dtype), OnResume.NOT_SAVED, "ns_dtype",
           FACTORY_KWARGS, "what Newton-Schulz multiplies in: 'bfloat16', 'float32' or 'auto'",
           bad="fp16", changed="float32"),
    Option("link_gbps", CostModel.link_gbps, Scope.OPTIMIZER, c.check_link_gbps, OnResume.NOT_SAVED, "link_gbps",
           FACTORY_KWARGS, "the cost model's per-rank bandwidth inside a replica, Gbit/s", bad=0.0, changed=100.0),
    Option("replica_link_gbps", CostModel.replica_link_gbps, Scope.OPTIMIZER, c.check_link_gbps,
           OnResume.NOT_SAVED, "replica_link_gbps", FACTORY_KWARGS,
           "the cost model's per-rank bandwidth to other replicas, Gbit/s", bad=-1.0, changed=50.0),
    Option("telemetry", False, Scope.OPTIMIZER, c.check_bool, OnResume.NOT_SAVED, "telemetry", FACTORY_KWARGS,
           "record each step's figures (DMuon.telemetry())", bad="yes", changed=True),
    Option("skip_nonfinite", False, Scope.OPTIMIZER, c.check_bool, OnResume.NOT_SAVED, "skip_nonfinite",
           FACTORY_KWARGS, "a step with a NaN or inf grad on any rank changes nothing anywhere", bad=1, changed=True),
    Option("foreach", None, Scope.FLAG, _keyed(check_foreach), OnResume.APPLIED, "implementation", "implementation",
           "elementwise rules and AdamW as list ops (None: torch's default for the device)", bad="yes", changed=True),
    Option("fused", None, Scope.FLAG, _keyed(check_fused), OnResume.APPLIED, "implementation", "implementation",
           "the AdamW part steps with torch's fused AdamW", bad="yes", changed=True),
    Option("maximize", False, Scope.FLAG, _no_path, OnResume.APPLIED, None, GROUP_KWARGS,
           "no such path in DMuon: False or None only", bad=True, changed=None),
    Option("capturable", False, Scope.FLAG, _keyed(check_capturable), OnResume.APPLIED, "capture_step", "capture_step",
           "lr and weight_decay as 0-dim device tensors, read on the device (a step a CUDA graph can capture)",
           bad="yes", changed=True),
    Option("differentiable", False, Scope.FLAG, _no_path, OnResume.APPLIED, None, GROUP_KWARGS,
           "no such path in DMuon: False or None only", bad=True, changed=None),
)
BY_NAME: Mapping[str, Option] = {option.name: option for option in OPTIONS}
# DMuon's keyword defaults, one per option (the constructor's signature reads them).
DEFAULTS: Mapping[str, Any] = {option.name: option.default for option in OPTIONS}


def _keys(*scopes: Scope) -> tuple[str, ...]:
    return tuple(dict.fromkeys(option.key for option in OPTIONS if option.scope in scopes))


# A Muon group's keys and an AdamW group's (besides params, use_muon and the flags).
MUON_KEYS = _keys(Scope.MUON, Scope.GROUPS)
ADAMW_KEYS = _keys(Scope.ADAMW, Scope.GROUPS)
# The keys whose one value serves both parts (unless an AdamW keyword below sets the AdamW part's).
SHARED_KEYS = _keys(Scope.GROUPS)
# The AdamW part's constructor keywords, each the AdamW group's value of its key.
ADAMW_ALIASES: Mapping[str, str] = {o.name: o.key for o in OPTIONS if o.scope is Scope.ADAMW}
# torch.optim's implementation flags, kept per group.
FLAG_KEYS = tuple(option.name for option in OPTIONS if option.scope is Scope.FLAG)
# The options of the whole optimizer (never a group's).
OPTIMIZER_OPTIONS = tuple(option.name for option in OPTIONS if option.scope is Scope.OPTIMIZER)
# What a DMuon keeps as its own attributes (and a pickle keeps): every whole-optimizer option
# but ``telemetry`` (its telemetry's), and torch's flags that have a path in DMuon.
OPTIMIZER_ATTRIBUTES = tuple(o.name for o in OPTIONS if o.name != "telemetry" and (
    o.scope is Scope.OPTIMIZER or (o.scope is Scope.FLAG and o.check is not _no_path)))
# What a resume does with each group key: applied (converted counts as applied) or refused.
APPLIED_ON_RESUME = tuple(dict.fromkeys(
    o.key for o in OPTIONS if o.on_resume in (OnResume.APPLIED, OnResume.CONVERTED)))
# Every key the table gives a meaning to, in a group or as a whole-optimizer option's name.
KNOWN_KEYS = tuple(dict.fromkeys(key for o in OPTIONS for key in (o.key, o.name)))
# ``use_muon`` is no option (it picks the algorithm), but a group's value of it decides
# the layout too.
LAYOUT_KEYS = ("use_muon", *(o.key for o in OPTIONS if o.on_resume is OnResume.REFUSED))


def check_group(values: dict[str, Any], use_muon: bool, where: str) -> None:
    """Check a Muon (``use_muon``) or AdamW group's values in place, in the table's order,
    raising ``ValueError`` naming ``where`` and the option; a checked value that has a
    canonical form (a tuple, a dtype's name) replaces the given one."""
    seen = set()
    for option in OPTIONS:
        applies = option.scope is Scope.GROUPS or option.scope is (Scope.MUON if use_muon else Scope.ADAMW)
        if applies and option.key in values and option.key not in seen:
            seen.add(option.key)
            values[option.key] = option.check(values[option.key], option.key, where)


def check_optimizer_options(values: Mapping[str, Any], where: str = "DMuon") -> dict[str, Any]:
    """The whole optimizer's options in ``values``, checked in the table's order; returned."""
    return {name: BY_NAME[name].check(values[name], name, where) for name in OPTIMIZER_OPTIONS if name in values}
