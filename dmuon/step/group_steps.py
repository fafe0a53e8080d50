"""Muon's update rules (``dmuon.numerics.update_rules``) and AdamW's run with one param group's
settings, counted and timed as ``DMuon`` reports them: each Newton-Schulz call adds its flops
to ``CommStats.ns_flops`` and its time to the telemetry, each in-place update is seen by the
telemetry's update/weight RMS. :meth:`GroupSteps.muon_local`: the ``local`` and
``redistribute`` paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from dmuon.exchange.comm import CommStats
from dmuon.exchange.reference import orthogonalize_gathered
from dmuon.exchange.status_channel import distributed
from dmuon.exchange.status_masks import StatusMasks, StepMask
from dmuon.numerics.masked_updates import mask_
from dmuon.numerics.newton_schulz import newton_schulz_flops, resolve_ns_algorithm, resolve_ns_dtype
from dmuon.numerics.standard_iteration import NewtonSchulzBuffers
from dmuon.numerics.update_rules import (StepScalars, apply_muon_, compute_copy, lookahead, momentum_, normuon_state,
                                         orthogonalize_update, resolve_foreach, shape_scale)
from dmuon.plan.paths import ALL_TO_ALL, REDISTRIBUTE
from dmuon.state.kept_state import MOMENTUM, MomentumReads, kept_momentum, make_momentum, read_chunks
from dmuon.state.rollback import StateRollback
from dmuon.step.telemetry import Telemetry
from dmuon.torch_compat import local_of

# The state key of NorMuon's per-row second moment (``dmuon.numerics.update_rules.normuon_state``).
NORMUON_STATE_KEY = "normuon_second_moment"
# Muon's state keys: kept in the dtype they were made (or saved) in.
MUON_STATE_KEYS = (*MOMENTUM.keys, NORMUON_STATE_KEY)


class GroupSteps:
    """Muon's and AdamW's steps with a group's settings, counted and timed."""

    def __init__(self, ns_dtype: str, stats: CommStats, telemetry: Telemetry, foreach: bool | None = None,
                 fused: bool | None = None) -> None:
        self.ns_dtype = ns_dtype
        self.stats = stats
        self.telemetry = telemetry
        self.foreach = foreach  # the optimizer's: None lets torch choose per device
        self.fused = fused  # the optimizer's: the AdamW part steps with torch's fused AdamW
        self.forms: dict[tuple[int, torch.device], bool] = {}  # each group's form on each device (lists_for)
        self.scalars = StepScalars()  # the step's device products, made once (GroupSteps lives one step)

    def orthogonalize(self, matrix: torch.Tensor, group: dict[str, Any],
                      second_moment: torch.Tensor | None = None, ok: torch.Tensor | None = None,
                      buffers: NewtonSchulzBuffers | None = None) -> torch.Tensor:
        """``update_rules.orthogonalize_update`` with the group's settings (NorMuon: the rows
        ``second_moment``, updated where ``ok`` holds), its flops counted and its time measured."""
        dtype, algorithm, flops = _ns_setup(tuple(matrix.shape), matrix.device.type, self.ns_dtype,
                                            group["ns_algorithm"], tuple(group["ns_gram_restarts"]),
                                            group["ns_steps"], group["split_rows"])
        self.stats.ns_flops += flops
        with self.telemetry.newton_schulz():
            return orthogonalize_update(matrix, group, dtype, algorithm, second_moment, ok, buffers)

    def lists_for(self, device: torch.device, group: dict[str, Any]) -> bool:
        """Whether ``group``'s rules run as list ops on ``device``: the group's ``foreach``
        where it sets one, else the optimizer's; decided once per group and device a step, as
        torch's ``adamw()``."""
        key = (id(group), device)
        if key not in self.forms:
            self.forms[key] = resolve_foreach(group.get("foreach", self.foreach), device)
        return self.forms[key]

    def lists_for_all(self, device: torch.device, groups: Iterable[dict[str, Any]]) -> bool:
        """Whether an op spanning several groups' tensors (an exchange batch, a store of momenta)
        runs as list ops: where each of the groups does."""
        return all(self.lists_for(device, group) for group in {id(g): g for g in groups}.values())

    def momentum(self, bufs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], group: dict[str, Any],
                 oks: Sequence[torch.Tensor] | None = None) -> None:
        """``update_rules.momentum_`` of one group's local tensors (``oks``: each one's mask)."""
        if bufs:
            momentum_(bufs, grads, group["momentum"], self.lists_for(bufs[0].device, group), oks)

    def lookahead(self, grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], group: dict[str, Any]
                  ) -> list[torch.Tensor]:
        """``update_rules.lookahead`` of one group's blocks, in their dtype (after
        :meth:`momentum`)."""
        if not grads:
            return []
        return lookahead(grads, bufs, group["momentum"], group["nesterov"], self.lists_for(grads[0].device, group))

    def apply_many(self, params: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                   orthos: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]],
                   oks: Sequence[torch.Tensor] | None = None) -> None:
        """``update_rules.apply_muon_`` of each ``target`` (its ``param``'s local tensor or rows of
        it, flat or shaped) with ``ortho`` (flat, or the matrix), one call per group and shape
        scale; with ``oks``, only where each target's mask holds (its ``ortho`` zero elsewhere)."""
        if not targets:
            return
        buckets: dict[tuple[int, float], tuple[dict[str, Any], float, list[int]]] = {}
        for k, (param, group) in enumerate(zip(params, groups)):
            scale = shape_scale(param.shape, group["adjust_lr"], group["matched_adamw_rms"], group["split_rows"])
            buckets.setdefault((id(group), scale), (group, scale, []))[2].append(k)
        targets, orthos = map(list, zip(*(_same_shape(t, o) for t, o in zip(targets, orthos))))
        with self.telemetry.updates(True, targets):
            for group, scale, members in buckets.values():
                apply_muon_([targets[k] for k in members], [orthos[k] for k in members], lr=group["lr"],
                            weight_decay=group["weight_decay"], scale=scale,
                            cautious_weight_decay=group["cautious_weight_decay"],
                            foreach=self.lists_for(targets[0].device, group),
                            oks=None if oks is None else [oks[k] for k in members],
                            capturable=bool(group.get("capturable")), scalars=self.scalars)

    @staticmethod
    def make_muon_state(grads: Mapping[torch.Tensor, torch.Tensor], groups: Mapping[torch.Tensor, dict[str, Any]],
                        state: MutableMapping[torch.Tensor, dict[str, Any]], rollback: StateRollback,
                        name_of: Callable[[torch.Tensor], str]) -> None:
        """At a Muon parameter's first grad: a zero momentum in the group's ``momentum_dtype``
        (``dmuon.state.kept_state``), and in a NorMuon group a zero second moment; recorded
        in ``rollback`` (a masked step's is taken back by the next)."""
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
    def second_moment(param: torch.Tensor, state: Mapping[torch.Tensor, dict[str, Any]]) -> torch.Tensor:
        """The whole NorMuon state of ``param`` on this rank (a NorMuon group's); zeros before
        it exists (no grad here yet: its rows start at zero)."""
        moment = state.get(param, {}).get(NORMUON_STATE_KEY)
        return local_of(normuon_state(param) if moment is None else moment)

    def muon_off_the_fast_path(self, param_groups: Sequence[dict[str, Any]], paths: Mapping[torch.Tensor, str],
                               grads: Mapping[torch.Tensor, torch.Tensor], status: StatusMasks,
                               state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        """Every Muon parameter off the fast path, through :meth:`muon_local`: the DTensors every
        step, grad or not, each under its mask (the reference path's collectives run everywhere);
        the plain ones with a grad here under no mask where the host knows the step stands,
        under the step's mask where only the device knows, not at all where it is masked."""
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
        """Muon for ``params`` of one group whole on this rank (``local``) or gathered whole on
        every rank (``redistribute``: ``dmuon.exchange.reference``), each under its mask in ``oks``
        (None: none). Without a grad here the momentum stands in for it (the masked EMA keeps it).
        Momenta are read a chunk at a time."""
        if not params:
            return
        states, local_params = [state.get(p) for p in params], [local_of(p) for p in params]
        foreach = self.lists_for(local_params[0].device, group)
        for chunk in read_chunks(states, local_params):  # (module dmuon.state.kept_state)
            self._muon_chunk(group, [params[i] for i in chunk], [states[i] for i in chunk],
                             None if oks is None else [oks[i] for i in chunk], paths, grads, state, foreach)

    def _muon_chunk(self, group: dict[str, Any], params: Sequence[torch.Tensor],
                    states: Sequence[Mapping[str, Any] | None], oks: Sequence[torch.Tensor] | None,
                    paths: Mapping[torch.Tensor, str], grads: Mapping[torch.Tensor, torch.Tensor],
                    state: Mapping[torch.Tensor, dict[str, Any]], foreach: bool) -> None:
        """:meth:`muon_local` of some of the group's parameters, whose momenta are read together:
        the EMA of all, then one update in hand at a time (torch's single-tensor Muon loop)."""
        local_params = [local_of(p) for p in params]
        momenta = MomentumReads()
        bufs = momenta.read(states, local_params, oks)
        local_grads = [local_of(grads[p]) if p in grads else buf for p, buf in zip(params, bufs)]
        momentum_(bufs, local_grads, group["momentum"], foreach, oks)
        for k, (param, target) in enumerate(zip(params, local_params)):
            ok = None if oks is None else [oks[k]]
            look = lookahead([local_grads[k]], [bufs[k]], group["momentum"], group["nesterov"], False)
            update = compute_copy(look.pop())  # no copy of the look-ahead held
            moment = self.second_moment(param, state) if group["normuon"] else None
            orthogonalize = functools.partial(self.orthogonalize, group=group, second_moment=moment,
                                              ok=None if ok is None else ok[0])
            # Newton-Schulz here, or on the whole matrix gathered on every rank (the reference path).
            ortho = (orthogonalize_gathered(update, param, orthogonalize) if paths[param] == REDISTRIBUTE
                     else orthogonalize(update))
            if ok is not None:
                mask_([ortho], ok, foreach)
            self.apply_many([param], [target], [ortho], [group], ok)
        momenta.store(foreach)


@functools.lru_cache(maxsize=1024)
def _ns_setup(shape: tuple[int, ...], device_type: str, ns_dtype: str, ns_algorithm: str,
              restarts: tuple[int, ...], ns_steps: int, split_rows: int | None) -> tuple[torch.dtype, str, int]:
    """Newton-Schulz's dtype, its algorithm as resolved for the device, and its flops (summed over
    the row blocks with ``split_rows``) for one shape and group settings, worked out once."""
    dtype = resolve_ns_dtype(ns_dtype, device_type)
    algorithm = resolve_ns_algorithm(ns_algorithm, dtype, device_type)
    blocks, unit = (shape[0] // split_rows, (split_rows, *shape[1:])) if split_rows else (1, shape)
    return dtype, algorithm, blocks * newton_schulz_flops(unit, ns_steps, algorithm, restarts)


def _same_shape(target: torch.Tensor, ortho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``target`` and ``ortho`` as views of one shape: a flat target as the (maybe transposed)
    matrix, or back."""
    if target.shape == ortho.shape:
        return target, ortho
    if target.is_contiguous():
        return target.view(ortho.shape), ortho
    return target, ortho.view(target.shape)


def by_group(indices: Iterable[int], group_at: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
    """``indices`` bucketed by their param group (by identity), in first-seen order."""
    buckets: dict[int, tuple[dict[str, Any], list[int]]] = {}
    for k in indices:
        group = group_at[k]
        buckets.setdefault(id(group), (group, []))[1].append(k)
    return list(buckets.values())
