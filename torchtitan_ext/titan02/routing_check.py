"""Resuming with a changed optimizer layout: refuse before DCP loads, naming what changed and the fix.

What DCP cannot load, or would load into the wrong layout, is found here from the
checkpoint's metadata (and the few group values that decide the layout), before
TorchTitan's ``dcp.load``, on every rank alike:

* an optimizer switch (AdamW <-> DMuon): the checkpoint has, or lacks, DMuon's group keys;
* NorMuon turned on or off: the checkpoint lacks, or has, ``normuon_second_moment``;
* head splitting toggled: the saved ``split_rows`` differ (the number of groups changes, so
  the LR scheduler's state must be left out too);
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

from ..routing import unwrapped_name
from ..versions import require_tested
from .container import DMuonOptimizersContainer

_GROUPS_PREFIX = "optimizer.param_groups."
_STATE_PREFIX = "optimizer.state."
# The state NorMuon adds to each Muon matrix, and the group key head splitting sets.
_NORMUON_STATE = "normuon_second_moment"
_SPLIT_ROWS = "split_rows"
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


def _saved_split_rows(checkpoint_id: str, names: list[str], keys: set[str]) -> dict[str, Any]:
    """The saved ``split_rows`` of the Muon parameters ``names`` (DCP keeps group values as
    pickled bytes; one small load, on every rank alike)."""
    wanted = {f"param_groups.{n}.{_SPLIT_ROWS}": None for n in names
              if f"{_GROUPS_PREFIX}{n}.{_SPLIT_ROWS}" in keys}
    if not wanted:
        return {}
    holder = {"optimizer": wanted}
    dcp.load(holder, checkpoint_id=checkpoint_id)
    return {k[len("param_groups."):-len(_SPLIT_ROWS) - 1]: v for k, v in holder["optimizer"].items()}


def check_layout(container: DMuonOptimizersContainer, checkpoint_id: str) -> None:
    """Refuse NorMuon toggled and head splitting toggled, naming the [optimizer] field."""
    keys = _metadata_keys(checkpoint_id)
    muon = {_dcp_name(o, p): (bool(g.get("normuon")), g.get(_SPLIT_ROWS)) for o in container.optimizers
            for g in o.param_groups if g["use_muon"] for p in g["params"]}
    muon = {n: v for n, v in muon.items() if f"{_GROUPS_PREFIX}{n}.use_muon" in keys}
    problems = []
    saved_normuon = {n for n in muon if f"{_STATE_PREFIX}{n}.{_NORMUON_STATE}" in keys}
    now_normuon = {n for n, (on, _) in muon.items() if on}
    if saved_normuon != now_normuon:
        problems.append(f"normuon = {str(bool(now_normuon)).lower()} now, {str(bool(saved_normuon)).lower()} in "
                        f"the checkpoint ({_NORMUON_STATE} is a state of its own)")
    saved_rows = _saved_split_rows(checkpoint_id, sorted(muon), keys)
    split = sorted(n for n, rows in saved_rows.items() if rows != muon[n][1])
    if split:
        problems.append(f"split_attention_heads changed ({len(split)} matrices, e.g. {split[0]}: split_rows "
                        f"{saved_rows[split[0]]} saved, {muon[split[0]][1]} now): the number of param groups changes")
    if problems:
        fix = EXCLUDE_OPTIMIZER_AND_SCHEDULER if split else EXCLUDE_OPTIMIZER
        raise ValueError(
            f"DMuon: the checkpoint {checkpoint_id} was saved with a different optimizer layout: "
            f"{'; '.join(problems)}. These [optimizer] fields cannot change on resume: set them back to the "
            f"checkpoint's values, or leave the optimizer state out ({fix}; the momentum restarts from zero)."
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
