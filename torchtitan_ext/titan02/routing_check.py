"""Resuming with a changed optimizer layout: refuse before DCP loads, naming what changed and the fix.

What DCP cannot load, or would load into the wrong layout, is found here from the
checkpoint's metadata (and the few group values that decide the layout), before
TorchTitan's ``dcp.load``, on every rank alike:

* an optimizer switch (AdamW <-> DMuon): the checkpoint has, or lacks, DMuon's group keys;
* a changed value of a key that decides the state's layout (the option table's
  ``LAYOUT_KEYS``: ``normuon``, ``split_rows`` set by ``split_attention_heads``); where only
  some matrices changed, the number of groups changes, so the LR scheduler's state must be
  left out too;
* a different Muon/AdamW routing (below).

Options that may change on resume are applied by DMuon's own ``load_state_dict``
(``dmuon.state.resume_contract``); the LR schedulers then take their base lrs from the groups
(``install``).

A parameter's optimizer (Muon or AdamW) comes from ``[optimizer] adamw_param_regex``
(and its ndim). Change the regex between a save and a resume and the optimizer state
no longer fits: DCP fails deep inside ``dcp.load`` with a "Missing key" for some
``betas`` or ``exp_avg``. This check runs just before TorchTitan's ``dcp_load``,
reads only the checkpoint's metadata (a parameter saved in a Muon group has a
``param_groups.<fqn>.momentum`` key), and stops with the parameters that moved and
the setting to restore.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import CheckpointManager, OPTIMIZER
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from dmuon.options import LAYOUT_KEYS

from ..routing import unwrapped_name
from ..versions import require_tested
from .container import DMuonOptimizersContainer

_GROUPS_PREFIX = "optimizer.param_groups."
_STATE_PREFIX = "optimizer.state."
# The group keys a resume refuses to change (the routing, use_muon, is check_routing's), and
# the [optimizer] field that sets one where its name is not the key's.
_LAYOUT_KEYS = tuple(key for key in LAYOUT_KEYS if key != "use_muon")
_FIELD_OF = {"split_rows": "split_attention_heads"}
# The fixes, as TorchTitan's command line spells them.
EXCLUDE_OPTIMIZER = "--checkpoint.exclude_from_loading optimizer"
EXCLUDE_OPTIMIZER_AND_SCHEDULER = "--checkpoint.exclude_from_loading optimizer,lr_scheduler"


def saved_routing(checkpoint_id: str) -> dict[str, bool]:
    """``{fqn: was it in a Muon group}`` for every parameter in a DCP checkpoint's optimizer."""
    keys = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    in_groups = {k[len(_GROUPS_PREFIX) : -len(".use_muon")] for k in keys
                 if k.startswith(_GROUPS_PREFIX) and k.endswith(".use_muon")}
    return {fqn: f"{_GROUPS_PREFIX}{fqn}.momentum" in keys for fqn in in_groups}


def current_routing(container: DMuonOptimizersContainer) -> dict[str, bool]:
    """``{fqn: is it in a Muon group}`` for the container's parameters, as DCP names them."""
    routing = {}
    for optimizer in container.optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                routing[unwrapped_name(optimizer.param_name(param))] = bool(group["use_muon"])
    return routing


def _metadata_keys(checkpoint_id: str) -> set[str]:
    return set(dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)


def _dcp_name(optimizer: Any, param: Any) -> str:
    return unwrapped_name(optimizer.param_name(param))


def check_switch(container: Any, checkpoint_id: str) -> None:
    """Refuse an optimizer switch (a DMuon checkpoint into AdamW, or the reverse), which DCP
    reports as a "Missing key" deep inside its load, with the recipe that works."""
    keys = _metadata_keys(checkpoint_id)
    if not any(k.startswith(_STATE_PREFIX) for k in keys):
        return  # no optimizer state saved (a model-only checkpoint)
    saved_dmuon = any(k.startswith(_GROUPS_PREFIX) and k.endswith(".use_muon") for k in keys)
    now_dmuon = isinstance(container, DMuonOptimizersContainer)
    if saved_dmuon == now_dmuon:
        return
    saved, now = ("DMuon", "another optimizer") if saved_dmuon else ("another optimizer (AdamW/Adam)", "DMuon")
    raise ValueError(
        f"The checkpoint {checkpoint_id} holds optimizer state written by {saved}, and this job trains with "
        f"{now}: that state cannot be loaded into it. To switch optimizers, load the weights and the step "
        f"count only: {EXCLUDE_OPTIMIZER_AND_SCHEDULER} (the number of param groups changes, so the LR "
        "schedule starts again from its warmup; add dataloader if the number of data-parallel ranks changed "
        "too). docs/torchtitan.md, \"Changing options on resume\", has the recipe both ways."
    )


def _saved_layout(checkpoint_id: str, names: list[str], keys: set[str]) -> dict[tuple[str, str], Any]:
    """``{(fqn, key): saved value}`` of the layout keys of the Muon parameters ``names`` (DCP
    keeps group values as pickled bytes; one small load, on every rank alike)."""
    wanted = {f"param_groups.{n}.{k}": (n, k) for n in names for k in _LAYOUT_KEYS
              if f"{_GROUPS_PREFIX}{n}.{k}" in keys}
    if not wanted:
        return {}
    holder = {"optimizer": dict.fromkeys(wanted)}
    dcp.load(holder, checkpoint_id=checkpoint_id)
    return {wanted[k]: v for k, v in holder["optimizer"].items()}


def _toml(value: Any) -> str:
    return "unset" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def check_layout(container: DMuonOptimizersContainer, checkpoint_id: str) -> None:
    """Refuse a changed layout key (NorMuon or head splitting toggled), naming the [optimizer] field."""
    keys = _metadata_keys(checkpoint_id)
    muon = {_dcp_name(o, p): g for o in container.optimizers for g in o.param_groups if g["use_muon"]
            for p in g["params"]}
    muon = {n: g for n, g in muon.items() if f"{_GROUPS_PREFIX}{n}.use_muon" in keys}
    saved = _saved_layout(checkpoint_id, sorted(muon), keys)
    problems, regroup = [], False
    for key in _LAYOUT_KEYS:
        changed = sorted(n for (n, k), value in saved.items() if k == key and value != muon[n].get(key))
        if changed:
            first = changed[0]
            regroup |= len(changed) < len(muon)  # some matrices only: they change group
            problems.append(f"{_FIELD_OF.get(key, key)} changed ({key} = {_toml(muon[first].get(key))} now, "
                            f"{_toml(saved[first, key])} in the checkpoint; {len(changed)} matrices, e.g. {first})")
    if problems:
        fix = EXCLUDE_OPTIMIZER_AND_SCHEDULER if regroup else EXCLUDE_OPTIMIZER
        groups = ": the number of param groups changes" if regroup else ""
        raise ValueError(
            f"DMuon: the checkpoint {checkpoint_id} was saved with a different optimizer layout: "
            f"{'; '.join(problems)}{groups}. These [optimizer] fields cannot change on resume: set them back to "
            f"the checkpoint's values, or leave the optimizer state out ({fix}; the momentum restarts from zero)."
        )


def check_routing(container: DMuonOptimizersContainer, checkpoint_id: str) -> None:
    """Raise ``ValueError`` naming every parameter whose optimizer differs from the checkpoint's."""
    saved = saved_routing(checkpoint_id)
    moved = {name: muon for name, muon in current_routing(container).items() if name in saved and saved[name] != muon}
    if not moved:
        return
    to_adamw = sorted(n for n, muon in moved.items() if not muon)
    to_muon = sorted(n for n, muon in moved.items() if muon)
    parts = ([f"Muon -> AdamW: {to_adamw}"] if to_adamw else []) + ([f"AdamW -> Muon: {to_muon}"] if to_muon else [])
    raise ValueError(
        f"DMuon: the checkpoint {checkpoint_id} was saved with a different Muon/AdamW routing; "
        f"{len(moved)} parameter(s) moved ({'; '.join(parts)}). The routing comes from "
        "[optimizer] adamw_param_regex: resume with the value the checkpoint was written with, "
        "or leave the optimizer state out (--checkpoint.exclude_from_loading optimizer)."
    )


def base_lrs_from_groups(schedulers: LRSchedulersContainer) -> None:
    """After the LR schedulers load their state: a DMuon's schedulers take their base lrs
    from its groups' ``initial_lr``, which ``dmuon.state.resume_contract`` set from the config, so
    a changed ``lr`` / ``adamw_lr`` holds for every later step, not only the first."""
    from dmuon import DMuon

    for scheduler in schedulers.schedulers:
        if isinstance(scheduler.optimizer, DMuon):
            groups = scheduler.optimizer.param_groups
            if len(scheduler.base_lrs) == len(groups):
                scheduler.base_lrs = [g["initial_lr"] for g in groups]


def install() -> None:
    """Run the checks above before TorchTitan loads a DCP checkpoint, and
    :func:`base_lrs_from_groups` after its LR schedulers load (idempotent)."""
    if getattr(CheckpointManager.dcp_load, "_dmuon_routing_check", False):
        return
    require_tested("0.2", "LRSchedulersContainer.load_state_dict (the base lrs a resume takes from the config)")
    load_schedulers = LRSchedulersContainer.load_state_dict

    @functools.wraps(load_schedulers)
    def load_state_dict(self: LRSchedulersContainer, state_dict: dict[str, Any]) -> None:
        load_schedulers(self, state_dict)
        base_lrs_from_groups(self)

    LRSchedulersContainer.load_state_dict = load_state_dict
    # No hook runs between reading a checkpoint's metadata and DCP's load.
    require_tested("0.2", "CheckpointManager.dcp_load (the Muon/AdamW routing check on resume)")
    original = CheckpointManager.dcp_load

    @functools.wraps(original)
    def dcp_load(self: CheckpointManager, state_dict: dict[str, Any], checkpoint_id: str, *args: Any,
                 **kwargs: Any) -> None:
        optimizers = state_dict.get(OPTIMIZER)  # absent when exclude_from_loading names it
        if isinstance(optimizers, OptimizersContainer):
            check_switch(optimizers, checkpoint_id)
        if isinstance(optimizers, DMuonOptimizersContainer):
            check_routing(optimizers, checkpoint_id)
            check_layout(optimizers, checkpoint_id)
        return original(self, state_dict, checkpoint_id, *args, **kwargs)

    dcp_load._dmuon_routing_check = True  # type: ignore[attr-defined]
    CheckpointManager.dcp_load = dcp_load
