"""The AdamW part of a step, under the step's mask (``dmuon.exchange.grad_status``).

The AdamW part runs no collective, so where this rank knows the step is masked it does nothing,
and where it knows the step stands it is torch's AdamW as is. In between, where only the device
knows (the status sums of a multi-rank ``DMuon``), it must leave every bit as it was when the
mask is False, without reading the mask on the host:

- fused AdamW without cautious decay: torch's own device skip, ``found_inf`` (the GradScaler
  path: the kernel writes nothing, the device step counters go back by 1);
- otherwise: this rank's AdamW tensors (parameters and moments) are copied before the step and
  selected back after it (``dmuon.numerics.masked_updates.select_``: a few list ops on CUDA), one
  group at a time (the copy's memory: one group's local shards, three times); torch's host step
  counters are incremented as usual and recorded, so the next step takes them back if the mask was
  False (``dmuon.state.rollback``). Prefer ``fused=True`` where torch has it: it costs nothing."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from dmuon.exchange.grad_status import usable_grad
from dmuon.exchange.status_masks import StatusMasks, StepMask
from dmuon.exchange.host_staging import ADAMW_MASK, HostStaging
from dmuon.numerics.adamw_rules import adamw_state, adamw_step_, adamw_steps
from dmuon.numerics.masked_updates import select_
from dmuon.state.rollback import StateRollback
from dmuon.step.telemetry import Telemetry
from dmuon.torch_compat import capturable_devices, local_of

State = MutableMapping[torch.Tensor, dict[str, Any]]


def adamw_part(param_groups: Sequence[dict[str, Any]], state: State, status: StatusMasks, telemetry: Telemetry,
               foreach: bool | None, fused: bool | None, rollback: StateRollback,
               summed: Mapping[torch.Tensor, torch.Tensor]) -> Exception | None:
    """Every AdamW group's step under ``status`` (``summed``: the replicated parameters' grads,
    :func:`dmuon.exchange.grad_status.usable_grad`); what torch raises is returned
    (``DMuon.step`` raises it at its end, after the collectives every rank runs)."""
    if status.mask is StepMask.MASKED:
        return None
    mask_on = _MaskOn(status)
    try:
        for group in (g for g in param_groups if not g["use_muon"]):
            _group_step(group, state, status, mask_on, telemetry, foreach, fused, rollback, summed)
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
                summed: Mapping[torch.Tensor, torch.Tensor]) -> None:
    """One group's parameters with a grad (state made at their first step, recorded)."""
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    fused = group.get("fused", fused)
    foreach = group.get("foreach", foreach)
    # torch's fused and capturable kernels read the step counters on the device
    device_step = fused or (group.get("capturable") and local_of(params[0]).device.type in capturable_devices())
    for param in params:
        if not state.get(param):
            made = adamw_state(param, device_step)
            state[param].update(made)
            rollback.made(state, param, made)
    states = [state[p] for p in params]
    moments = [s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states]
    counters = adamw_steps(states, params, device_step)
    settings = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                    cautious_weight_decay=group["cautious_weight_decay"], foreach=foreach, fused=fused,
                    capturable=bool(group.get("capturable")))
    lists = (params, [usable_grad(p, summed) for p in params], moments[: len(params)], moments[len(params):], counters)
    with telemetry.updates(False, [local_of(p) for p in params]):
        if status.mask is StepMask.STANDS:
            adamw_step_(*lists, **settings)
        elif fused and not group["cautious_weight_decay"]:
            adamw_step_(*lists, found_inf=(~mask_on(local_of(params[0]).device)).to(torch.float32), **settings)
        else:
            # Counters on an accelerator are selected like the tensors; torch's host counters
            # are taken back by the next step if it was masked (exact: they count by 1).
            host = [c for c in counters if c.device.type == "cpu"]
            selected = [local_of(t) for t in (*params, *moments)] + [c for c in counters if c.device.type != "cpu"]
            # Copies in one list op (a product by exactly 1 keeps every bit), not one per tensor.
            befores = [t.clone() for t in selected] if foreach is False else torch._foreach_mul(selected, 1.0)
            adamw_step_(*lists, **settings)
            masked = {device: ~mask_on(device) for device in {t.device for t in selected}}
            # masked: the bits from before
            select_(selected, [masked[t.device] for t in selected], befores, foreach is not False)
            rollback.counted(host)
