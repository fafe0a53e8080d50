"""The AdamW part of a step, under the step's mask (``dmuon.exchange.grad_status``).

The AdamW part runs no collective, so where this rank knows the step is masked it does nothing,
and where it knows the step stands it is torch's AdamW as is. In between, where only the device
knows (the status sums of a multi-rank ``DMuon``), it must leave every bit as it was when the
mask is False, without reading the mask on the host:

- fused AdamW without cautious decay: torch's own device skip, ``found_inf`` (the GradScaler
  path: the kernel writes nothing, the device step counters go back by 1; moments kept in bf16
  or int8 are stored back only where the step stands);
- otherwise: this rank's AdamW tensors (parameters and kept moments) are copied before the step and
  selected back after it (``dmuon.numerics.masked_updates.select_``: a few list ops on CUDA), one
  piece at a time (``dmuon.state.kept_state.step_pieces``: the copy's memory is a piece's local
  shards, three times); torch's host step
  counters are incremented as usual and recorded, so the next step takes them back if the mask was
  False (``dmuon.state.rollback``). Prefer ``fused=True`` where torch has it: it costs nothing."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from dmuon.exchange.grad_status import usable_grad
from dmuon.exchange.status_masks import StatusMasks, StepMask
from dmuon.exchange.host_staging import ADAMW_MASK, HostStaging
from dmuon.numerics.adamw_rules import adamw_step_, adamw_step_counter, adamw_steps, steps_as_local
from dmuon.numerics.masked_updates import select_
from dmuon.state.kept_state import (ADAMW_MOMENTS, MomentumReads, Piece, adamw_wanted, kept_momentum,
                                    make_momentum, rows_of, state_rows, step_pieces)
from dmuon.state.rollback import StateRollback
from dmuon.step.telemetry import Telemetry
from dmuon.torch_compat import capturable_devices, local_of

State = MutableMapping[torch.Tensor, dict[str, Any]]


def adamw_part(param_groups: Sequence[dict[str, Any]], state: State, status: StatusMasks, telemetry: Telemetry,
               foreach: bool | None, fused: bool | None, rollback: StateRollback,
               summed: Mapping[torch.Tensor, torch.Tensor], name_of: Callable[[torch.Tensor], str]) -> Exception | None:
    """Every AdamW group's step under ``status`` (``summed``: the replicated parameters' grads,
    :func:`dmuon.exchange.grad_status.usable_grad`); what torch raises is returned
    (``DMuon.step`` raises it at its end, after the collectives every rank runs)."""
    if status.mask is StepMask.MASKED:
        return None
    mask_on = _MaskOn(status)
    try:
        for group in (g for g in param_groups if not g["use_muon"]):
            _group_step(group, state, status, mask_on, telemetry, foreach, fused, rollback, summed, name_of)
    except Exception as error:  # noqa: BLE001 - re-raised by DMuon.step() after the collectives
        return error
    return None


class _MaskOn:
    """The step's mask where the AdamW tensors are: as it is on its own device; on the host
    beside an accelerator's mask (FSDP2's CPU offload), brought down once a step, one
    documented wait (``dmuon.exchange.host_staging.ADAMW_MASK``)."""

    def __init__(self, status: StatusMasks) -> None:
        self.status = status
        self.found: dict[torch.device, torch.Tensor] = {}

    def __call__(self, device: torch.device) -> torch.Tensor:
        if device not in self.found:
            ok = self.status.step_ok
            self.found[device] = ok if ok.device == device else \
                HostStaging(ok.device).down(ADAMW_MASK, ok, ADAMW_MASK).to(device)
        return self.found[device]


def _group_step(group: dict[str, Any], state: State, status: StatusMasks, mask_on: _MaskOn, telemetry: Telemetry,
                foreach: bool | None, fused: bool | None, rollback: StateRollback,
                summed: Mapping[torch.Tensor, torch.Tensor], name_of: Callable[[torch.Tensor], str]) -> None:
    """One group's parameters with a grad (state made at their first step, recorded), stepped a
    piece at a time (``dmuon.state.kept_state.step_pieces``: all at once where every moment is
    held in its parameter's dtype; rows of a parameter whose moments are kept in another)."""
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    fused = group.get("fused", fused)
    foreach = group.get("foreach", foreach)
    # torch's fused and capturable kernels read the step counters on the device
    device_step = fused or (group.get("capturable") and local_of(params[0]).device.type in capturable_devices())
    _make_state(group, params, state, device_step, rollback, name_of)
    states = [state[p] for p in params]
    counters = adamw_steps(states, params, device_step)
    grads = [usable_grad(p, summed) for p in params]
    settings = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                    cautious_weight_decay=group["cautious_weight_decay"], foreach=foreach, fused=fused,
                    capturable=bool(group.get("capturable")))
    local_params = [local_of(p) for p in params]
    cuttable = [steps_as_local(p, g) and local_of(p).is_contiguous() and local_of(g).is_contiguous()
                for p, g in zip(params, grads)]
    skip: dict[str, torch.Tensor] = {}
    ok = masked = None
    if status.mask is not StepMask.STANDS and fused and not group["cautious_weight_decay"]:
        ok = mask_on(local_params[0].device)
        # torch's skip leaves the working moments as read: their stores are selected by ``ok``
        skip = dict(found_inf=(~ok).to(torch.float32))
    elif status.mask is not StepMask.STANDS:
        # This rank's tensors are copied before each piece and the masked bits selected back after it.
        # Counters on an accelerator are selected like them; torch's host counters are taken back
        # by the next step if it was masked (exact: they count by 1).
        masked = {device: ~mask_on(device) for device in {t.device for t in local_params}}
        on_device = [c for c in counters if c.device.type != "cpu"]
        counters_before = _copies(on_device)
    firsts: dict[int, torch.Tensor] = {}  # a cut parameter's counter as it was: each of its pieces counts from it
    with telemetry.updates(False, local_params):
        for piece in step_pieces(states, local_params, ADAMW_MOMENTS, cuttable):
            piece_params, piece_grads, piece_states, piece_counters, likes = _piece_tensors(
                piece, params, grads, states, counters, firsts)
            _piece_step(piece_params, piece_grads, piece_states, piece_counters, likes, settings, skip,
                        None if ok is None else [ok] * len(likes), masked)
            if piece.rows is not None:  # the parameter's counter: where its pieces' copies counted to
                counters[piece.index[0]].copy_(piece_counters[0])
        if masked is not None:
            select_(on_device, [masked[c.device] for c in on_device], counters_before, foreach is not False)
            rollback.counted([c for c in counters if c.device.type == "cpu"])


def _make_state(group: dict[str, Any], params: list[torch.Tensor], state: State, device_step: bool,
                rollback: StateRollback, name_of: Callable[[torch.Tensor], str]) -> None:
    """The moments and step counter of each of ``params`` without state yet (its first grad), in
    the form its group asks for, recorded for a step that raises."""
    for param in params:
        if not state.get(param):
            made = make_momentum(param, adamw_wanted(param, group.get("state_dtype")), state[param],
                                 name_of(param), ADAMW_MOMENTS)
            state[param]["step"] = adamw_step_counter(param, device_step)
            rollback.made(state, param, [*made, "step"])


def _piece_tensors(piece: Piece, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict[str, Any]],
                   counters: list[torch.Tensor], firsts: dict[int, torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
    """A piece's parameters, grads, states, step counters and local tensors: the group's own, or
    views of one parameter's rows with a copy of its counter as it was before the step (``firsts``)."""
    if piece.rows is None:
        chosen = [params[i] for i in piece.index]
        return (chosen, [grads[i] for i in piece.index], [states[i] for i in piece.index],
                [counters[i] for i in piece.index], [local_of(p) for p in chosen])
    (i,) = piece.index
    rows = [rows_of(local_of(params[i]), piece.rows)]
    return (rows, [rows_of(local_of(grads[i]), piece.rows)], [state_rows(states[i], piece.rows, ADAMW_MOMENTS)],
            [firsts.setdefault(i, counters[i].clone()).clone()], rows)


def _piece_step(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict[str, Any]],
                counters: list[torch.Tensor], likes: list[torch.Tensor], settings: dict[str, Any],
                skip: dict[str, torch.Tensor], oks: list[torch.Tensor] | None,
                masked: dict[torch.device, torch.Tensor] | None) -> None:
    """torch's AdamW on one piece: its moments read (``dmuon.state.kept_state.MomentumReads``),
    stepped and stored (where ``oks`` hold); with ``masked``, its parameters and kept moments
    copied first and selected back where their device's mask holds."""
    foreach = settings["foreach"] is not False
    if masked is not None:
        selected = likes + [local_of(t) for s in states for keys in ADAMW_MOMENTS for t in kept_momentum(s, keys)
                            if t is not None]
        # Copies in one list op per dtype (a product by exactly 1 keeps every bit), not one per tensor.
        befores = [t.clone() for t in selected] if not foreach else _copies(selected)
    reads = MomentumReads()
    moments = [reads.read(states, likes, oks, keys) for keys in ADAMW_MOMENTS]
    adamw_step_(params, grads, *moments, counters, **settings, **skip)
    reads.store(foreach)
    if masked is not None:
        select_(selected, [masked[t.device] for t in selected], befores, foreach)  # masked: the bits from before


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors``, one list op per dtype (torch's multi-tensor kernel takes one dtype;
    a product by exactly 1 keeps every bit; int8 values are cloned: a product would widen them)."""
    copies: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        same = [tensors[i] for i in members]
        made = torch._foreach_mul(same, 1.0) if dtype.is_floating_point or dtype.is_complex else [t.clone() for t in same]
        for i, copy in zip(members, made):
            copies[i] = copy
    return copies  # type: ignore[return-value]
