"""AdamW for the AdamW part: its step counter as torch.optim.AdamW makes it, and its update,
delegated to torch's functional AdamW so its bits are ``torch.optim.AdamW``'s: the
local-shard lists DMuon hands it, cautious weight decay with AdamW's direction, and the
``capturable`` form with device hyperparameters (``dmuon.numerics.device_scalars``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as _torch_adamw

from dmuon.numerics.device_scalars import StepScalars
from dmuon.numerics.update_rules import cautious_decay_, decay_, decay_factor, keep_factor
from dmuon.torch_compat import capturable_devices, default_foreach_for, dtensor_where_it_is, local_of, scalar_dtype


def _local_lists(params: list[torch.Tensor], grads: list[torch.Tensor],
                 *moments: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The lists as their local tensors when each DTensor grad has its parameter's mesh and
    placements (FSDP2's case): AdamW is elementwise, so each shard's update is the bits DTensor
    would compute, without DTensor's dispatch per op (a few microseconds a tensor). The moments
    may be DTensors like their parameters or their local tensors (a working copy of a kept
    state: ``dmuon.state.kept_state``). Otherwise (a ``Partial`` grad, say, which DTensor
    redistributes inside the op) DTensors throughout: a foreach op cannot mix the two kinds."""
    if all(steps_as_local(p, g) for p, g in zip(params, grads)):
        return [[local_of(t) for t in tensors] for tensors in (params, grads, *moments)]
    return [params, grads, *([m if isinstance(m, DTensor) or not isinstance(p, DTensor) else
                              dtensor_where_it_is(m, p.device_mesh, p.placements, p.shape)
                              for m, p in zip(ms, params)] for ms in moments)]


def steps_as_local(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``param`` steps as its local tensor with ``grad``'s (:func:`_local_lists`): a plain
    tensor, or a DTensor whose grad has its mesh and placements."""
    return not isinstance(param, DTensor) or (isinstance(grad, DTensor) and grad.device_mesh == param.device_mesh
                                              and grad.placements == param.placements)


def adamw_direction_sign(exp_avg: torch.Tensor, grad: torch.Tensor, beta1: float) -> torch.Tensor:
    """The sign of the AdamW step's direction ``m_hat / (sqrt(v_hat) + eps)`` about to be
    taken: that of the first moment after this grad (the other factors are positive)."""
    return torch.sign(exp_avg.lerp(grad, 1 - beta1))


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float | torch.Tensor,
                betas: tuple[float, float], eps: float, weight_decay: float, cautious_weight_decay: bool = False,
                foreach: bool | None = None, fused: bool | None = None, found_inf: torch.Tensor | None = None,
                capturable: bool = False) -> None:
    """One AdamW step, delegated to torch's functional AdamW so the bits match ``torch.optim.AdamW``
    with the same hyperparameters, a one-element Tensor ``lr`` included (it also handles complex
    tensors; DTensors step as their local tensors where :func:`_local_lists` allows). ``foreach``
    and ``fused``: torch's options (None: torch's default for the device; ``fused`` wins over
    ``foreach``, and needs each ``steps`` entry an fp32 tensor on its parameter's device).

    With ``cautious_weight_decay`` the decay is :func:`cautious_decay_` with AdamW's direction
    ``u = m_hat / (sqrt(v_hat) + eps)`` (its sign: :func:`adamw_direction_sign`), applied first,
    as torch applies its decay, and torch's step then runs without decay. (Where ``u`` would
    underflow to 0 while the moment is not 0, the sign of the moment decides; torch computes ``u``
    inside its step.) A complex parameter, whose entries have no sign, keeps the plain decay.

    ``found_inf`` (fused only, as in torch): a 0-dim float on the parameters' device; 1.0 skips
    the step on the device (parameters, moments and step counts keep their bits).

    ``capturable``: ``lr`` and ``weight_decay`` are 0-dim fp64 device tensors
    (``dmuon.numerics.device_scalars``); :func:`adamw_capturable_` runs the step."""
    if capturable:
        adamw_capturable_(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, betas=betas, eps=eps,
                          weight_decay=weight_decay, cautious_weight_decay=cautious_weight_decay, foreach=foreach,
                          fused=fused, found_inf=found_inf)
        return
    if cautious_weight_decay and weight_decay != 0:
        scalars = StepScalars()
        keep = keep_factor(lr, weight_decay, scalars)
        plain = []  # complex entries have no sign: the plain decay
        for param, grad, exp_avg in zip(params, grads, exp_avgs):
            local = local_of(param)
            if param.is_complex():
                plain.append(local)
                continue
            direction = adamw_direction_sign(local_of(exp_avg), local_of(grad), betas[0])
            cautious_decay_(local, direction, decay_factor(keep, local.dtype, scalars, device=local.device)[0])
        decay_(plain, keep, False, scalars)
        weight_decay = 0.0
    if foreach is None and fused is None:  # torch's own default, decided on the tensors as given, not their shards
        foreach = default_foreach_for(params) and not isinstance(lr, torch.Tensor)
    tensors = _local_lists(params, grads, exp_avgs, exp_avg_sqs)
    _torch_adamw(*tensors, [], steps, foreach=foreach, fused=fused, has_complex=any(p.is_complex() for p in params),
                 amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr, weight_decay=weight_decay, eps=eps,
                 maximize=False, found_inf=found_inf)


def adamw_capturable_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: torch.Tensor,
                      betas: tuple[float, float], eps: float, weight_decay: torch.Tensor, cautious_weight_decay: bool,
                      foreach: bool | None, fused: bool | None, found_inf: torch.Tensor | None) -> None:
    """:func:`adamw_step_` with ``lr`` and ``weight_decay`` as 0-dim fp64 device tensors, no
    host read. The decay ``p *= 1 - lr * wd`` runs first, on the device (torch's own first
    op on its for-loop and foreach paths; cautious: :func:`cautious_decay_`), then torch's
    AdamW without decay:

    - on a device torch's ``capturable`` path takes (CUDA): that path (step counts and bias
      corrections on the device; fused: the kernel reads a Tensor lr in fp32);
    - elsewhere (the CPU, where torch refuses ``capturable``): the paths torch allows a Tensor
      lr without it, the for-loop or fused; bits equal to a float ``lr``."""
    _decay_on_device_(params, grads, exp_avgs, lr, weight_decay, betas[0], cautious_weight_decay, foreach, found_inf)
    on_device = params[0].device.type in capturable_devices()
    if fused and on_device:
        lr = lr.to(torch.float32)  # torch's fused kernels read a Tensor lr as fp32
    if not on_device and not fused:
        foreach = False  # torch refuses a Tensor lr on the list path without capturable
    elif foreach is None and fused is None:
        foreach = default_foreach_for(params)
    _torch_adamw(*_local_lists(params, grads, exp_avgs, exp_avg_sqs), [], steps, foreach=foreach, fused=fused,
                 capturable=on_device and not fused, has_complex=any(p.is_complex() for p in params),
                 amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr, weight_decay=0.0, eps=eps, maximize=False,
                 found_inf=found_inf)


def _decay_on_device_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      lr: torch.Tensor, weight_decay: torch.Tensor, beta1: float, cautious_weight_decay: bool,
                      foreach: bool | None, found_inf: torch.Tensor | None = None) -> None:
    """``p *= 1 - lr * weight_decay`` with the factor made on the device (the one decay,
    ``dmuon.numerics.update_rules.decay_``: list ops unless ``foreach`` is False); cautious:
    per tensor, where update and weight agree in sign (a complex parameter: plain).
    ``found_inf`` (torch's skip, 1.0: skip) masks it: the factor is exactly 1 where it is set,
    since the fused kernel that reads it skips only its own update, not this decay."""
    scalars = StepScalars()
    keep = keep_factor(lr, weight_decay, scalars, capturable=True)
    ok = None if found_inf is None else found_inf == 0
    plain = []
    for param, grad, exp_avg in zip(params, grads, exp_avgs):
        local = local_of(param)
        if cautious_weight_decay and not param.is_complex():
            factor, _ = decay_factor(keep, local.dtype, scalars, ok, capturable=True)
            cautious_decay_(local, adamw_direction_sign(local_of(exp_avg), local_of(grad), beta1), factor)
        else:
            plain.append(local)
    decay_(plain, keep, foreach is not False, scalars, None if ok is None else [ok] * len(plain), capturable=True)


def adamw_step_counter(param: torch.Tensor, device_step: bool | None = None) -> torch.Tensor:
    """A parameter's AdamW ``step`` before its first step, as torch.optim.AdamW makes it
    (``device_step``, for fused or capturable AdamW: in fp32 on the parameter's device, where
    those kernels read it; else on the host). Its moments: ``dmuon.state.kept_state``."""
    if device_step:
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.tensor(0.0, dtype=scalar_dtype())


def adamw_steps(states: Sequence[dict[str, torch.Tensor]], params: Sequence[torch.Tensor],
                device_step: bool | None) -> list[torch.Tensor]:
    """Each parameter's AdamW ``step`` counter; with ``device_step`` (fused or capturable kernels)
    in fp32 on the parameter's device, where torch.optim.AdamW(fused=True) keeps it: a counter made
    otherwise (another implementation's checkpoint, a switch to fused) is moved once, exactly."""
    if device_step:
        for state, param in zip(states, params):
            if state["step"].device != param.device or state["step"].dtype != torch.float32:
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
    return [state["step"] for state in states]
