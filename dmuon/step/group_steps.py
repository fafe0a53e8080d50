"""The functional Muon and AdamW steps (``dmuon.numerics.functional``) run with one param
group's settings, measured as ``DMuon`` reports them: every Newton-Schulz call adds its
flops to ``CommStats.ns_flops`` and its time to the telemetry, and every in-place update
is seen by the telemetry's update/weight RMS.

A NorMuon group's normalization is part of :meth:`GroupSteps.orthogonalize`: it runs
wherever Newton-Schulz runs, on the whole matrix, with the rows of the state it reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from dmuon.exchange.comm import CommStats
from dmuon.exchange.reference import orthogonalize_gathered
from dmuon.numerics.functional import (
    muon_,
    newton_schulz,
    newton_schulz_work,
    normuon_normalize_,
    normuon_state,
    update_scale,
)
from dmuon.exchange.status_channel import distributed
from dmuon.state.momentum_state import (BUFFER_KEY, INT8_KEY, SCALES_KEY, MomentumReads, kept_momentum, make_momentum,
                                  read_chunks)
from dmuon.exchange.status_masks import StatusMasks, StepMask
from dmuon.numerics.device_scalars import StepScalars
from dmuon.numerics.newton_schulz import resolve_ns_algorithm, resolve_ns_dtype
from dmuon.numerics.standard_iteration import NewtonSchulzBuffers
from dmuon.numerics.update_lists import apply_muon_, lookahead, momentum_, resolve_foreach
from dmuon.plan.paths import ALL_TO_ALL, REDISTRIBUTE
from dmuon.state.rollback import StateRollback
from dmuon.step.telemetry import Telemetry
from dmuon.torch_compat import local_of

# The Muon group values the update rules read (the rest configure Newton-Schulz).
MUON_STEP_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "adjust_lr", "matched_adamw_rms", "split_rows",
                  "cautious_weight_decay")
# The state key of NorMuon's per-row second moment (``dmuon.numerics.functional.normuon_state``).
NORMUON_STATE_KEY = "normuon_second_moment"
# Muon's state keys: kept in the dtype they were made (or saved) in.
MUON_STATE_KEYS = (BUFFER_KEY, INT8_KEY, SCALES_KEY, NORMUON_STATE_KEY)


class GroupSteps:
    """Muon's and AdamW's steps with a group's settings, counted and timed."""

    def __init__(self, ns_dtype: str, stats: CommStats, telemetry: Telemetry, foreach: bool | None = None,
                 fused: bool | None = None) -> None:
        self.ns_dtype = ns_dtype
        self.stats = stats
        self.telemetry = telemetry
        self.foreach = foreach
        """The optimizer's ``foreach``: None lets torch choose per device (``dmuon.numerics.update_lists``)."""
        self.fused = fused
        """The optimizer's ``fused``: the AdamW part steps with torch's fused AdamW."""
        self.forms: dict[tuple[int, torch.device], bool] = {}
        """Each group's form on each device, this step (:meth:`lists_for`)."""
        self.scalars = StepScalars()
        """A capturable step's device products of its hyperparameters, made once (a step's
        ``GroupSteps`` lives for that step only)."""

    def orthogonalize(self, matrix: torch.Tensor, group: dict[str, Any],
                      second_moment: torch.Tensor | None = None, ok: torch.Tensor | None = None,
                      buffers: NewtonSchulzBuffers | None = None) -> torch.Tensor:
        """Newton-Schulz with the group's settings (``buffers``: kept between matrices of one
        shape, ``dmuon.numerics.standard_iteration``), then, in a NorMuon group, the
        normalization with ``second_moment`` (the NorMuon state's rows of ``matrix``,
        updated in place where the 0-dim device bool ``ok`` holds); counts the flops run
        on this rank."""
        dtype, algorithm, flops = _ns_setup(tuple(matrix.shape), matrix.device.type, self.ns_dtype,
                                            group["ns_algorithm"], tuple(group["ns_gram_restarts"]),
                                            group["ns_steps"], group["split_rows"])
        gram = dict(ns_algorithm=algorithm, ns_gram_restarts=group["ns_gram_restarts"])
        self.stats.ns_flops += flops
        with self.telemetry.newton_schulz():
            ortho = newton_schulz(matrix, ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"],
                                  eps=group["eps"], ns_dtype=dtype, split_rows=group["split_rows"], buffers=buffers,
                                  **gram)
            if group["normuon"]:
                if buffers is not None:  # its fp32 copies come next: freed first, the peak stays one matrix's
                    buffers.release()
                ortho = normuon_normalize_(ortho, second_moment, group["normuon_beta2"], group["split_rows"], ok)
            return ortho

    def lists_for(self, device: torch.device, group: dict[str, Any]) -> bool:
        """Whether the elementwise rules of ``group`` run as list ops on ``device``: the
        group's ``foreach`` where it sets one (torch keeps it per group), else the optimizer's.
        Decided once per group and device a step (``GroupSteps`` lives for one step), as
        torch's ``adamw()`` decides its form once and passes it down; every rule asks here."""
        key = (id(group), device)
        if key not in self.forms:
            self.forms[key] = resolve_foreach(group.get("foreach", self.foreach), device)
        return self.forms[key]

    def lists_for_all(self, device: torch.device, groups: Iterable[dict[str, Any]]) -> bool:
        """Whether an op spanning several groups' tensors (a batch of the owner exchange, a store
        of momenta) runs as list ops: where each of the groups does (a group's ``foreach=False``
        holds for its tensors there too)."""
        return all(self.lists_for(device, group) for group in {id(g): g for g in groups}.values())

    def momentum(self, bufs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], group: dict[str, Any],
                 oks: Sequence[torch.Tensor] | None = None) -> None:
        """The momentum EMA of one group's local tensors, in place; with ``oks``, where each
        0-dim device bool holds (``dmuon.numerics.update_lists.momentum_``)."""
        if bufs:
            momentum_(bufs, grads, group["momentum"], self.lists_for(bufs[0].device, group), oks)

    def lookahead(self, grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], group: dict[str, Any]
                  ) -> list[torch.Tensor]:
        """What one group's blocks orthogonalize, in their dtype (after :meth:`momentum`)."""
        if not grads:
            return []
        return lookahead(grads, bufs, group["momentum"], group["nesterov"], self.lists_for(grads[0].device, group))

    def apply_many(self, params: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                   orthos: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]],
                   oks: Sequence[torch.Tensor] | None = None) -> None:
        """The decayed, scaled update of each ``target`` (its ``param``'s local tensor or
        rows of it, flat or shaped) with ``ortho`` (flat, or the matrix), one list op per
        group, shape scale, device and dtype; with ``oks``, only where each target's 0-dim
        device bool holds (its ``ortho`` already zero elsewhere)."""
        if not targets:
            return
        buckets: dict[tuple[int, float], tuple[dict[str, Any], float, list[int]]] = {}
        for k, (param, group) in enumerate(zip(params, groups)):
            scale = _scale(param.shape, group["split_rows"], group["adjust_lr"], group["matched_adamw_rms"])
            buckets.setdefault((id(group), scale), (group, scale, []))[2].append(k)
        targets, orthos = map(list, zip(*(_same_shape(t, o) for t, o in zip(targets, orthos))))
        with self.telemetry.muon_updates(targets):
            for group, scale, members in buckets.values():
                apply_muon_([targets[k] for k in members], [orthos[k] for k in members], lr=group["lr"],
                            weight_decay=group["weight_decay"], scale=scale,
                            cautious_weight_decay=group["cautious_weight_decay"],
                            foreach=self.lists_for(targets[0].device, group),
                            oks=None if oks is None else [oks[k] for k in members], capturable=capturable(group),
                            scalars=self.scalars)

    @staticmethod
    def make_muon_state(grads: Mapping[torch.Tensor, torch.Tensor], groups: Mapping[torch.Tensor, dict[str, Any]],
                        state: MutableMapping[torch.Tensor, dict[str, Any]], rollback: StateRollback,
                        name_of: Callable[[torch.Tensor], str]) -> None:
        """At a Muon parameter's first grad: a zero momentum in the group's ``momentum_dtype``
        (``dmuon.state.momentum_state``), and in a NorMuon group a zero second moment
        (``dmuon.numerics.functional.normuon_state``); what is made is recorded in
        ``rollback`` (a masked step's is taken back by the next)."""
        for param in grads:
            made = []
            if kept_momentum(state[param]) is None:
                made += make_momentum(param, groups[param]["momentum_dtype"], state[param], name_of(param))
            if groups[param]["normuon"] and NORMUON_STATE_KEY not in state[param]:
                state[param][NORMUON_STATE_KEY] = normuon_state(param)
                made.append(NORMUON_STATE_KEY)
            if made:
                rollback.made(state, param, made)

    @staticmethod
    def second_moment(param: torch.Tensor, state: Mapping[torch.Tensor, dict[str, Any]]) -> torch.Tensor | None:
        """The whole NorMuon state of ``param`` on this rank (None outside NorMuon groups)."""
        moment = state.get(param, {}).get(NORMUON_STATE_KEY)
        return None if moment is None else local_of(moment)

    def muon_off_the_fast_path(self, param_groups: Sequence[dict[str, Any]], paths: Mapping[torch.Tensor, str],
                               grads: Mapping[torch.Tensor, torch.Tensor], status: StatusMasks,
                               state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        """Every Muon group's parameters the fast path did not run, through :meth:`muon_local`:
        the DTensors every step, grad or not, each under its mask (the reference path's
        collectives run on every rank alike); the plain ones with a grad here under no mask
        where the host knows the step stands, under the step's mask where only the device
        knows, not at all where it is masked."""
        for group in (g for g in param_groups if g["use_muon"]):
            off = [p for p in group["params"] if paths[p] != ALL_TO_ALL]
            plain = {p for p in off if p in grads and not distributed(p)}
            if status.mask is StepMask.ON_DEVICE:
                masked = [p for p in off if p in status or p in plain]
                self.muon_local(group, masked, [status[p] if p in status else status.step_ok for p in masked], paths,
                                grads, state)
                continue
            shared = [p for p in off if p in status]
            self.muon_local(group, shared, [status[p] for p in shared], paths, grads, state)
            if status.mask is StepMask.STANDS:
                self.muon_local(group, [p for p in off if p in plain], None, paths, grads, state)

    def muon_local(self, group: dict[str, Any], params: Sequence[torch.Tensor], oks: Sequence[torch.Tensor] | None,
                   paths: Mapping[torch.Tensor, str], grads: Mapping[torch.Tensor, torch.Tensor],
                   state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        """Muon (``dmuon.numerics.functional.muon_``) for ``params`` of one group that are whole
        on this rank (``local``: orthogonalized in place) or gathered whole on every rank
        (``redistribute``: ``dmuon.exchange.reference``), each under its 0-dim device bool in
        ``oks`` (None: no mask). A parameter without a grad here steps its momentum as its
        grad (the masked EMA leaves it as it is). Momenta are read a chunk at a time."""
        if not params:
            return
        states, local_params = [state.get(p) for p in params], [local_of(p) for p in params]
        foreach = self.lists_for(local_params[0].device, group)
        for chunk in read_chunks(states, local_params):  # (module dmuon.state.momentum_state)
            self._muon_chunk(group, [params[i] for i in chunk], [states[i] for i in chunk],
                             None if oks is None else [oks[i] for i in chunk], paths, grads, state, foreach)

    def _muon_chunk(self, group: dict[str, Any], params: Sequence[torch.Tensor],
                    states: Sequence[Mapping[str, Any] | None], oks: Sequence[torch.Tensor] | None,
                    paths: Mapping[torch.Tensor, str], grads: Mapping[torch.Tensor, torch.Tensor],
                    state: Mapping[torch.Tensor, dict[str, Any]], foreach: bool) -> None:
        """:meth:`muon_local` of some of the group's parameters, whose momenta are read together
        (their working copies die with this call, before the next chunk's are read)."""
        local_params = [local_of(p) for p in params]
        momenta = MomentumReads()
        bufs = momenta.read(states, local_params, oks)
        muon_(local_params, [local_of(grads[p]) if p in grads else buf for p, buf in zip(params, bufs)], bufs,
              shapes=[p.shape for p in params],
              orthogonalize=lambda k, update: self._orthogonalize_whole(group, params[k], update, paths, state,
                                                                        None if oks is None else oks[k]),
              updating=self.telemetry.muon_update, foreach=foreach, capturable=capturable(group),
              scalars=self.scalars, oks=oks, **{key: group[key] for key in MUON_STEP_KEYS})
        momenta.store(foreach)

    def _orthogonalize_whole(self, group: dict[str, Any], param: torch.Tensor, update: torch.Tensor,
                             paths: Mapping[torch.Tensor, str], state: Mapping[torch.Tensor, dict[str, Any]],
                             ok: torch.Tensor | None) -> torch.Tensor:
        """Newton-Schulz of one parameter's update: here, or gathered on every rank."""
        moment = self.second_moment(param, state)
        if group["normuon"] and moment is None:  # no state yet (no grad here): its rows start at zero
            moment = local_of(normuon_state(param))

        def orthogonalize(full: torch.Tensor) -> torch.Tensor:
            return self.orthogonalize(full, group, moment, ok)

        return orthogonalize_gathered(update, param, orthogonalize) if paths[param] == REDISTRIBUTE \
            else orthogonalize(update)


def capturable(group: dict[str, Any]) -> bool:
    """Whether the group's hyperparameters are device tensors (``DMuon(capturable=True)``)."""
    return bool(group.get("capturable"))


@functools.lru_cache(maxsize=1024)
def _ns_setup(shape: tuple[int, ...], device_type: str, ns_dtype: str, ns_algorithm: str,
              restarts: tuple[int, ...], ns_steps: int, split_rows: int | None) -> tuple[torch.dtype, str, int]:
    """Newton-Schulz's dtype, its algorithm as resolved for the device, and its flops, for
    one matrix shape and group settings: the same answers every step, so worked out once
    (a step orthogonalizes hundreds of matrices of a few shapes)."""
    dtype = resolve_ns_dtype(ns_dtype, device_type)
    algorithm = resolve_ns_algorithm(ns_algorithm, dtype, device_type)
    flops = newton_schulz_work(shape, ns_steps=ns_steps, split_rows=split_rows, ns_algorithm=algorithm,
                               ns_gram_restarts=restarts)
    return dtype, algorithm, flops


def _same_shape(target: torch.Tensor, ortho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``target`` and ``ortho`` as views of one shape: a flat target seen as the matrix
    (a result may be a transposed view), or a flat result seen as a shaped target."""
    if target.shape == ortho.shape:
        return target, ortho
    if target.is_contiguous():
        return target.view(ortho.shape), ortho
    return target, ortho.view(target.shape)


@functools.lru_cache(maxsize=None)
def _scale(shape: tuple[int, ...], split_rows: int | None, adjust_lr: str | None, matched_adamw_rms: float) -> float:
    """``update_scale``, computed once per shape and setting."""
    return update_scale(shape, split_rows=split_rows, adjust_lr=adjust_lr, matched_adamw_rms=matched_adamw_rms)


def by_group(indices: Iterable[int], group_at: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
    """``indices`` bucketed by their param group (by identity), in first-seen order."""
    buckets: dict[int, tuple[dict[str, Any], list[int]]] = {}
    for k in indices:
        group = group_at[k]
        buckets.setdefault(id(group), (group, []))[1].append(k)
    return list(buckets.values())
