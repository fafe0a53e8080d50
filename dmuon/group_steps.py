"""The functional Muon and AdamW steps (``dmuon.functional``) run with one param
group's settings, measured as ``DMuon`` reports them: every Newton-Schulz call adds its
flops to ``CommStats.ns_flops`` and its time to the telemetry, and every in-place update
is seen by the telemetry's update/weight RMS.

A NorMuon group's normalization is part of :meth:`GroupSteps.orthogonalize`: it runs
wherever Newton-Schulz runs, on the whole matrix, with the rows of the state it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dmuon.comm import CommStats
from dmuon.functional import (
    adamw_, adamw_state, apply_muon_update_, muon_, newton_schulz, newton_schulz_work, normuon_normalize_,
    normuon_state, update_scale,
)
from dmuon.newton_schulz import resolve_ns_algorithm, resolve_ns_dtype
from dmuon.plan import ALL_TO_ALL, REDISTRIBUTE
from dmuon.telemetry import Telemetry
from dmuon.transport.reference import orthogonalize_gathered

# The Muon group values the update rules read (the rest configure Newton-Schulz).
MUON_STEP_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "adjust_lr", "matched_adamw_rms", "split_rows",
                  "cautious_weight_decay")
# The state key of NorMuon's per-row second moment (``dmuon.functional.normuon_state``).
NORMUON_STATE_KEY = "normuon_second_moment"


class GroupSteps:
    """Muon's and AdamW's steps with a group's settings, counted and timed."""

    def __init__(self, ns_dtype: str, stats: CommStats, telemetry: Telemetry) -> None:
        self.ns_dtype = ns_dtype
        self.stats = stats
        self.telemetry = telemetry

    def orthogonalize(self, matrix: torch.Tensor, group: dict[str, Any],
                      second_moment: torch.Tensor | None = None) -> torch.Tensor:
        """Newton-Schulz with the group's settings, then, in a NorMuon group, the
        normalization with ``second_moment`` (the NorMuon state's rows of ``matrix``,
        updated in place); counts the flops run on this rank."""
        dtype = resolve_ns_dtype(self.ns_dtype, matrix.device.type)
        gram = dict(ns_algorithm=resolve_ns_algorithm(group["ns_algorithm"], dtype, matrix.device.type),
                    ns_gram_restarts=group["ns_gram_restarts"])
        self.stats.ns_flops += newton_schulz_work(matrix.shape, ns_steps=group["ns_steps"],
                                                  split_rows=group["split_rows"], **gram)
        with self.telemetry.newton_schulz():
            ortho = newton_schulz(matrix, ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"],
                                  eps=group["eps"], ns_dtype=dtype, split_rows=group["split_rows"], **gram)
            if group["normuon"]:
                ortho = normuon_normalize_(ortho, second_moment, group["normuon_beta2"], group["split_rows"])
            return ortho

    def apply(self, param: torch.Tensor, target: torch.Tensor, ortho: torch.Tensor, group: dict[str, Any]) -> None:
        """The decayed, scaled update of ``target`` (``param``'s local tensor or rows of it)."""
        scale = update_scale(param.shape, split_rows=group["split_rows"], adjust_lr=group["adjust_lr"],
                             matched_adamw_rms=group["matched_adamw_rms"])
        with self.telemetry.muon_update(target):
            apply_muon_update_(target, ortho, group["lr"], group["weight_decay"], scale,
                               group["cautious_weight_decay"])

    @staticmethod
    def make_muon_state(grads: Mapping[torch.Tensor, torch.Tensor], groups: Mapping[torch.Tensor, dict[str, Any]],
                        state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        """At a Muon parameter's first grad: a zero momentum buffer, and in a NorMuon
        group a zero second moment (``dmuon.functional.normuon_state``)."""
        for param in grads:
            if "momentum_buffer" not in state[param]:
                state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if groups[param]["normuon"] and NORMUON_STATE_KEY not in state[param]:
                state[param][NORMUON_STATE_KEY] = normuon_state(param)

    @staticmethod
    def second_moment(param: torch.Tensor, state: Mapping[torch.Tensor, dict[str, Any]]) -> torch.Tensor | None:
        """The whole NorMuon state of ``param`` on this rank (None outside NorMuon groups)."""
        moment = state[param].get(NORMUON_STATE_KEY)
        return None if moment is None else _local(moment)

    def muon_whole(self, group: dict[str, Any], paths: Mapping[torch.Tensor, str],
                   grads: Mapping[torch.Tensor, torch.Tensor], state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        """Muon for the group's parameters with a grad that are whole on this rank
        (``local``: orthogonalized in place) or gathered whole on every rank
        (``redistribute``: ``dmuon.transport.reference``); the fast path ran the others."""
        params = [p for p in group["params"] if p in grads and paths[p] != ALL_TO_ALL]

        def orthogonalize(i: int, update: torch.Tensor) -> torch.Tensor:
            moment = self.second_moment(params[i], state)
            if paths[params[i]] == REDISTRIBUTE:
                return orthogonalize_gathered(update, params[i], lambda full: self.orthogonalize(full, group, moment))
            return self.orthogonalize(update, group, moment)

        muon_([_local(p) for p in params], [_local(grads[p]) for p in params],
              [_local(state[p]["momentum_buffer"]) for p in params], shapes=[p.shape for p in params],
              orthogonalize=orthogonalize, updating=self.telemetry.muon_update,
              **{key: group[key] for key in MUON_STEP_KEYS})

    def adamw(self, group: dict[str, Any], state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        """AdamW for the group's parameters with a grad (state made at their first step)."""
        params = [p for p in group["params"] if p.grad is not None]
        for param in params:
            if not state[param]:
                state[param].update(adamw_state(param))
        if params:
            states = [state[p] for p in params]
            with self.telemetry.adamw_update([_local(p) for p in params]):
                adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                       [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr=group["lr"],
                       betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                       cautious_weight_decay=group["cautious_weight_decay"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own data: the local shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
