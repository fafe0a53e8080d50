"""Resuming with a different Muon/AdamW routing: name the parameters that moved.

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

from torchtitan.components.checkpoint import CheckpointManager

from ..versions import require_tested
from .container import DMuonOptimizersContainer

_GROUPS_PREFIX = "optimizer.param_groups."
# Module wrappers TorchTitan may add (activation checkpointing, torch.compile, FSDP1):
# DCP drops them from the fully qualified names it saves.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


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
                name = ".".join(s for s in optimizer.param_name(param).split(".") if s not in _WRAPPER_SEGMENTS)
                routing[name] = bool(group["use_muon"])
    return routing


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


def install() -> None:
    """Run :func:`check_routing` before TorchTitan loads a DCP checkpoint (idempotent)."""
    if getattr(CheckpointManager.dcp_load, "_dmuon_routing_check", False):
        return
    # No hook runs between reading a checkpoint's metadata and DCP's load.
    require_tested("0.2", "CheckpointManager.dcp_load (the Muon/AdamW routing check on resume)")
    original = CheckpointManager.dcp_load

    @functools.wraps(original)
    def dcp_load(self: CheckpointManager, state_dict: dict[str, Any], checkpoint_id: str, *args: Any,
                 **kwargs: Any) -> None:
        for value in state_dict.values():
            if isinstance(value, DMuonOptimizersContainer):
                check_routing(value, checkpoint_id)
        return original(self, state_dict, checkpoint_id, *args, **kwargs)

    dcp_load._dmuon_routing_check = True  # type: ignore[attr-defined]
    CheckpointManager.dcp_load = dcp_load
