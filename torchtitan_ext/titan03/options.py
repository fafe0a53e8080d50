"""DMuon's options in a TorchTitan 0.3.x optimizer config: where each goes, and its checks.

* group options (each option whose row of ``dmuon.options.table`` has the place
  ``GROUP_KWARGS``: ``lr``, ``momentum``, ``ns_steps``, the AdamW part's ``adamw_<x>``, ...)
  and the routing keys ``adamw_param_regex`` and ``split_attention_heads``: the group's
  ``optimizer_kwargs``;
* whole-optimizer options (the table's ``FACTORY_KWARGS`` rows: ``comm``, ``ns_dtype``, ...,
  and the container's ``capture_step``: ``torchtitan_ext.captured_steps``):
  ``optimizer_factory_kwargs_by_name["DMuon"]``.

TorchTitan adds ``fused`` / ``foreach`` (from ``implementation``) to every group
dict; the container drops those from DMuon's groups and gives ``implementation`` to
DMuon as its whole-optimizer ``foreach`` / ``fused`` instead
(``torchtitan_ext.implementation``), so a checkpoint's group keys stay as they were.
A DMuon group's own ``foreach`` / ``fused`` in its ``optimizer_kwargs`` override that
for the group, as TorchTitan's per-group ``optimizer_kwargs`` do for Adam/AdamW
(``fused`` goes to the group's AdamW part). Every value is checked by
``validate_dmuon_config``, which ``DMuonOptimizersContainer.Config.__post_init__``
calls (so also after command-line overrides), with dmuon's own validators and the
config field in the message.
"""

from __future__ import annotations

import re
from typing import Any

from torchtitan.components.optimizer import OptimizersContainer

from dmuon.options import (DEFAULTS, FACTORY_KWARGS, GROUP_OPTIONS, NO_PATH_KEYS, OPTIONS, check_bool, check_group,
                           check_no_fused_muon, check_no_path_flags, check_optimizer_options, own_flags,
                           part_values, split_options)

from ..field_checks import check_number, Interval, NON_NEGATIVE, UNIT
from ..implementation import dmuon_implementation
from ..routing import DEFAULT_ADAMW_PARAM_REGEX

DMUON_NAME = "DMuon"
# The container's whole-optimizer option (not DMuon's): DMuon(capturable=True), its step
# captured in a CUDA graph (``torchtitan_ext.captured_steps``).
CAPTURE_STEP = "capture_step"
# Group keys the container reads to split a DMuon group (DMuon never sees them).
ROUTING_KEYS = ("adamw_param_regex", "split_attention_heads")
# DMuon's options that are the whole optimizer's (its constructor's, not a group's), and the
# container's capture_step (``dmuon.options.table``: those taken in ``FACTORY_KWARGS``).
FACTORY_OPTIONS = (*(o.name for o in OPTIONS if o.titan03 == FACTORY_KWARGS), CAPTURE_STEP)
# Group options dmuon's validator would report under another name (``adamw_lr`` as the AdamW
# part's ``lr``, ``adamw_betas`` as ``betas``) or that may be None: checked first, as written.
# A Tensor lr is left to dmuon's validator (torch.optim's one-element rule).
NAMED_NUMBERS: dict[str, Interval] = {"adamw_lr": NON_NEGATIVE, "adamw_weight_decay": NON_NEGATIVE,
                                      "adamw_eps": NON_NEGATIVE}
PAIRS = {"adamw_betas": UNIT}
# DMuon's defaults, from its option table.
DMUON_DEFAULTS = DEFAULTS
# The whole-optimizer options' defaults: DMuon's, and the container's capture_step (off).
FACTORY_DEFAULTS = {**{k: DMUON_DEFAULTS[k] for k in FACTORY_OPTIONS if k != CAPTURE_STEP}, CAPTURE_STEP: False}


def check_group_options(options: dict[str, Any], where: str, implementation: dict[str, Any] | None = None) -> None:
    """Raise ``ValueError`` naming ``where`` for a DMuon group's bad key or value.

    The values are checked by the validators ``DMuon(...)`` runs on each group it
    builds (``dmuon.options.param_groups.build_param_groups``: the flags it has no path for,
    then each part's values and flags), with this group's options over DMuon's defaults
    and ``implementation`` (DMuon's ``foreach`` / ``fused`` from the config's).
    """
    use_muon = options.get("use_muon")
    if use_muon is not None and not isinstance(use_muon, bool):
        raise ValueError(f"{where}: use_muon must be a bool, got {use_muon!r}")
    routing = ROUTING_KEYS if use_muon is None else ()
    known = GROUP_OPTIONS[use_muon] | set(routing) | {"use_muon"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)} for a DMuon group"
                         f"{'' if use_muon is None else f' with use_muon={use_muon}'}; known: {sorted(known)} "
                         f"(whole-optimizer options go in optimizer.optimizer_factory_kwargs_by_name"
                         f"[{DMUON_NAME!r}])")
    _check_routing(options, where)
    _check_as_written(options, where)
    check_no_fused_muon(options, use_muon, where)
    check_no_path_flags({key: options[key] for key in NO_PATH_KEYS if key in options}, where)
    muon_defaults, adamw_defaults = split_options(DMUON_DEFAULTS)
    for kind in (True, False) if use_muon is None else (use_muon,):
        mine = {k: v for k, v in options.items() if k in GROUP_OPTIONS[kind]}
        defaults = muon_defaults if kind else adamw_defaults
        _check_part(kind, mine, defaults, where if kind else f"{where} (AdamW part)", implementation or {},
                    split=use_muon is None)


def _check_part(use_muon: bool, options: dict[str, Any], defaults: dict[str, Any], where: str,
                implementation: dict[str, Any], split: bool) -> None:
    """What ``make_group`` checks of a Muon (``use_muon``) or AdamW group, without its
    parameters: the values over ``defaults`` (``check_group``) and the flags (``own_flags``).
    No group is made: ``capturable=True`` would put its lr on the parameters' device, and a
    config has no parameters yet."""
    values = part_values(options, use_muon, defaults, split)
    check_group(values, use_muon, where)
    own_flags([], use_muon, options, values["lr"], implementation, where)


def _check_as_written(options: dict[str, Any], where: str) -> None:
    """The AdamW part's numbers finite and in range, each message naming the key as written
    (the flags and the other numbers are dmuon's to check, under their own names)."""
    for key, interval in NAMED_NUMBERS.items():
        if options.get(key) is not None:
            check_number(options[key], key, f"{where}:", interval)
    for key, interval in PAIRS.items():
        if options.get(key) is not None:  # None: unset, as DMuon takes it in a group
            pair = options[key]
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"{where}: {key} must be two numbers (beta1, beta2), got {pair!r}")
            for index, value in enumerate(pair):
                check_number(value, f"{key}[{index}]", f"{where}:", interval)


def _check_routing(options: dict[str, Any], where: str) -> None:
    regex = options.get("adamw_param_regex", DEFAULT_ADAMW_PARAM_REGEX)
    try:
        re.compile(regex)
    except (re.error, TypeError) as error:
        raise ValueError(f"{where}: adamw_param_regex {regex!r} is not a Python regular expression "
                         f"({error})") from None
    heads = options.get("split_attention_heads", False)
    if not isinstance(heads, bool):
        raise ValueError(f"{where}: split_attention_heads must be a bool, got {heads!r}")


def check_factory_options(options: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` for a bad whole-optimizer option."""
    unknown = set(options) - set(FACTORY_OPTIONS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; it takes DMuon's whole-optimizer "
                         f"options {list(FACTORY_OPTIONS)} (group options go in a param group's "
                         "optimizer_kwargs)")
    merged = {**FACTORY_DEFAULTS, **options}
    check_optimizer_options(merged, where)
    check_bool(merged[CAPTURE_STEP], CAPTURE_STEP, where)


def validate_dmuon_config(config: OptimizersContainer.Config) -> None:
    """Check every DMuon setting of an optimizer config; the message names the field."""
    groups = [(index, group) for index, group in enumerate(config.param_groups) if group.optimizer_name == DMUON_NAME]
    factory = config.optimizer_factory_kwargs_by_name.get(DMUON_NAME)
    # No model yet: "fused" is taken as fusing the AdamW part, which is what refuses least;
    # capture_step is DMuon's capturable, every group's flag unless the group sets its own.
    implementation = dmuon_implementation(config.implementation) if groups else None
    if implementation is not None and factory:
        implementation["capturable"] = factory.get(CAPTURE_STEP) is True
    for index, group in groups:
        check_group_options(group.optimizer_kwargs, f"optimizer.param_groups[{index}].optimizer_kwargs",
                            implementation)
    if factory is not None:
        check_factory_options(factory, f"optimizer.optimizer_factory_kwargs_by_name[{DMUON_NAME!r}]")
