"""What ``DMuon.load_state_dict`` does when the saved group options differ from the optimizer's own.

torch's ``Optimizer.load_state_dict`` replaces every group's options with the saved ones, so
a run resumed with a changed ``ns_steps`` or ``momentum`` silently keeps the old values.
DMuon's options carry algorithmic meaning (Newton-Schulz steps, QK-clip, NorMuon), so it
states a contract instead, enforced by a load-state-dict pre-hook (``dmuon.state.optimizer_hooks``):

* the options in :data:`APPLIED_ON_RESUME` can change between a save and a resume: the
  optimizer's own value (the current configuration) is kept, and each change is logged
  once, ``DMuon: changed on resume: ns_steps 5 -> 1``; a key the optimizer's group leaves
  unset (a ``foreach`` or ``fused`` of the saved group's own) is dropped, logged alike, so
  the group steps with the optimizer's flags, as configured;
* the options in :data:`LAYOUT_KEYS`, the number of groups and the number of parameters in
  each decide the state's layout (which tensors exist, for which parameters): a state dict
  that differs in any of them is refused before anything is loaded, naming each key; so is
  a saved group without one of its kind's options (not a state dict of this optimizer).

The learning rate under an LR scheduler (a group with ``initial_lr``): the configured value
is ``initial_lr``; when it changed, the saved ``lr`` (the schedule's value for the next step)
is scaled by new / old, so the schedule keeps its place. The scheduler's own ``base_lrs``
come from its state dict: set them from the groups' ``initial_lr`` after loading it (the
TorchTitan containers do).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

# Which options a resume applies and which it refuses: each option's row of the table says.
from dmuon.options.table import ADAMW_KEYS, APPLIED_ON_RESUME, KNOWN_KEYS, LAYOUT_KEYS, MUON_KEYS

logger = logging.getLogger("dmuon")

# The keys an LR scheduler (torch's LRScheduler) adds and drives.
LR, INITIAL_LR = "lr", "initial_lr"
# How a refusal says what to do.
REFUSAL_FIX = ("Construct DMuon with the options the state was saved with, or do not load this optimizer state "
               "(start it afresh). In TorchTitan: --checkpoint.exclude_from_loading optimizer, plus lr_scheduler "
               "when the number of groups changed.")


def apply_resume_contract(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The load-state-dict pre-hook: refuse a layout change, keep the optimizer's own values
    of the options that may change, log each change. Returns the state dict to load."""
    saved_groups, groups = state_dict["param_groups"], optimizer.param_groups
    problems = layout_problems(saved_groups, groups)
    if problems:
        raise ValueError("DMuon: the state dict does not fit this optimizer; these change the state's layout "
                         f"and cannot change on resume: {'; '.join(problems)}. {REFUSAL_FIX}")
    changes: dict[tuple[str, str, str], list[int]] = {}
    merged = []
    for index, (saved, mine) in enumerate(zip(saved_groups, groups)):
        group = dict(saved)
        for key, old, new in _apply(group, saved, mine):
            changes.setdefault((key, old, new), []).append(index)
        merged.append(group)
    for (key, old, new), indices in changes.items():
        where = "" if len(indices) == len(groups) else f" (group{'s' if len(indices) > 1 else ''} " \
                                                       f"{', '.join(map(str, indices))})"
        logger.info(f"DMuon: changed on resume: {key} {old} -> {new}{where}")
    return {**state_dict, "param_groups": merged}


def layout_problems(saved_groups: Sequence[dict[str, Any]], groups: Sequence[dict[str, Any]]) -> list[str]:
    """What differs in the state's layout between the saved groups and the optimizer's, in words."""
    if len(saved_groups) != len(groups):
        return [f"the number of param groups (saved {len(saved_groups)}, now {len(groups)}: head splitting "
                "(split_rows) or the Muon/AdamW routing changed)"]
    problems = []
    for index, (saved, mine) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(mine["params"]):
            problems.append(f"group {index} holds {len(mine['params'])} parameters, saved {len(saved['params'])} "
                            "(the Muon/AdamW routing changed)")
        missing = [key for key in ("use_muon", *(MUON_KEYS if mine.get("use_muon") else ADAMW_KEYS))
                   if key in mine and key not in saved]
        if missing:
            problems.append(f"group {index} was saved without the option(s) {missing} (not a state dict of "
                            "this optimizer)")
        for key in LAYOUT_KEYS:
            if key in mine and key in saved and saved[key] != mine[key]:
                problems.append(f"group {index} {key}: saved {saved[key]!r}, now {mine[key]!r}")
    return problems


def _apply(group: dict[str, Any], saved: dict[str, Any], mine: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Set ``group`` (a copy of ``saved``) to ``mine``'s values of the applied options;
    return the changes as (key, old, new) texts."""
    changes = []
    scheduled = INITIAL_LR in mine and INITIAL_LR in saved
    for key in KNOWN_KEYS:  # a key this group leaves unset (a flag: the optimizer's) or not of its kind
        if key not in mine and key in saved:
            del group[key]
            changes.append((key, _text(saved[key]), "unset"))
    for key in APPLIED_ON_RESUME:
        if key not in mine or (key == LR and scheduled):
            continue
        if key in saved and _same(saved[key], mine[key]):
            continue
        group[key] = mine[key]
        changes.append((key, _text(saved[key]) if key in saved else "unset", _text(mine[key])))
    if scheduled and not _same(saved[INITIAL_LR], mine[INITIAL_LR]):
        old, new = _number(saved[INITIAL_LR]), _number(mine[INITIAL_LR])
        group[INITIAL_LR] = mine[INITIAL_LR]
        # Keep the schedule's factor (lr / initial_lr) at the step the state was saved.
        group[LR] = saved[LR] * (new / old) if old else mine[LR]
        changes.append((LR, _text(old), _text(new)))
    return changes


def _number(value: Any) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):  # a saved 1 is no True: the group takes the optimizer's
        return a is b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _number(a) == _number(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # a tuple saved may come back a list
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _text(value: Any) -> str:
    return f"{_number(value):g}" if isinstance(value, torch.Tensor) else str(value)
