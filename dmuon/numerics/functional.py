"""Muon and AdamW as functions of tensors and hyperparameters, in the style of
``torch.optim._muon._single_tensor_muon``: no param groups, no optimizer state, no
process groups. ``DMuon`` decides where each piece runs; these say what it computes.

A Muon step of one parameter is three pieces, so the distributed paths can run each
where it belongs (momentum and the update on the local shard, Newton-Schulz on the
owner): :func:`muon_momentum_`, :func:`newton_schulz` and :func:`apply_muon_update_`, each
one tensor's call of the one list implementation (``dmuon.numerics.update_lists``).
:func:`muon_` chains them for tensors this rank orthogonalizes as they come.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import torch
from torch.distributed.tensor import DTensor, Replicate

from dmuon.numerics.newton_schulz import (
    DEFAULT_GRAM_RESTARTS,
    DEFAULT_NS_ALGORITHM,
    Triple,
    matrix_shape,
    newton_schulz_flops,
    orthogonalize,
    orthogonalize_row_blocks,
)
from dmuon.numerics.device_scalars import StepScalars
from dmuon.numerics.standard_iteration import NewtonSchulzBuffers
from dmuon.numerics.masked_updates import mask_
from dmuon.numerics.update_lists import apply_muon_, momentum_
from dmuon.numerics.adamw_rules import adamw_step_ as adamw_
from dmuon.numerics.update_rules import (
    lookahead_copy,
    normuon_normalize_,
    normuon_second_moment_shape,
    shape_scale,
)
from dmuon.torch_compat import dtensor_where_it_is, scalar_dtype

# Orthogonalizes the update of the ``i``-th tensor of a :func:`muon_` call.
Orthogonalize = Callable[[int, torch.Tensor], torch.Tensor]
# Wraps the in-place update of one tensor (telemetry measures it there).
Updating = Callable[[torch.Tensor], ContextManager[Any]]

__all__ = ["adamw_", "adamw_state", "adamw_steps", "apply_muon_update_", "muon_", "muon_momentum_", "newton_schulz", "newton_schulz_work",
           "normuon_normalize_", "normuon_state", "update_scale"]


def newton_schulz(
    update: torch.Tensor,
    *,
    ns_coefficients: str | Triple | Sequence[Triple],
    ns_steps: int,
    eps: float,
    ns_dtype: torch.dtype,
    split_rows: int | None,
    ns_algorithm: str = DEFAULT_NS_ALGORITHM,
    ns_gram_restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS,
    buffers: NewtonSchulzBuffers | None = None,
) -> torch.Tensor:
    """Newton-Schulz of a parameter-shaped update, or of one unit of it: its matrix, each
    expert of a stack, or (``split_rows``) each block of that many rows on its own.
    Returns a new bf16 tensor of ``update``'s shape (``buffers``: see
    :mod:`dmuon.numerics.standard_iteration`)."""
    shape = matrix_shape(update.shape)
    matrix = update if update.shape == shape else update.view(shape)  # a view is an op: only when needed
    gram = dict(algorithm=ns_algorithm, restarts=ns_gram_restarts, buffers=buffers)
    if split_rows:
        ortho = orthogonalize_row_blocks(matrix, split_rows, ns_coefficients, ns_steps, eps, ns_dtype, **gram)
    else:
        ortho = orthogonalize(matrix, ns_coefficients, ns_steps, eps, ns_dtype, **gram)
    return ortho if ortho.shape == update.shape else ortho.view(update.shape)


def newton_schulz_work(shape: Sequence[int], *, ns_steps: int, split_rows: int | None,
                       ns_algorithm: str = DEFAULT_NS_ALGORITHM,
                       ns_gram_restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> int:
    """The flops :func:`newton_schulz` runs on an update of ``shape`` (the sum over its
    row blocks with ``split_rows``), ``ns_algorithm`` as resolved for the device."""
    blocks, unit = (shape[0] // split_rows, (split_rows, *shape[1:])) if split_rows else (1, shape)
    return blocks * newton_schulz_flops(unit, ns_steps, ns_algorithm, ns_gram_restarts)


def update_scale(shape: Sequence[int], *, split_rows: int | None, adjust_lr: str | None,
                 matched_adamw_rms: float) -> float:
    """The factor on ``lr`` for a parameter of ``shape``; with ``split_rows`` each row
    block is its own matrix for the scale too."""
    return shape_scale((split_rows, shape[1]) if split_rows else shape, adjust_lr, matched_adamw_rms)


def muon_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_bufs: Sequence[torch.Tensor],
    *,
    shapes: Sequence[Sequence[int]],
    lr: float | torch.Tensor,
    momentum: float,
    nesterov: bool,
    weight_decay: float | torch.Tensor,
    adjust_lr: str | None,
    matched_adamw_rms: float,
    split_rows: int | None,
    orthogonalize: Orthogonalize,
    updating: Updating = lambda _: contextlib.nullcontext(),
    cautious_weight_decay: bool = False,
    foreach: bool = False,
    capturable: bool = False,
    scalars: StepScalars | None = None,
    oks: Sequence[torch.Tensor] | None = None,
) -> None:
    """torch's single-tensor Muon loop over tensors this rank updates whole: its own
    ``params`` (plain tensors, or local tensors of DTensors of global ``shapes``), with
    ``orthogonalize(i, update)`` computing Newton-Schulz (and NorMuon's normalization)
    where the path puts it. The momentum EMA runs first for every tensor (with
    ``foreach``, one list op: ``dmuon.numerics.update_lists``); the rest, per tensor, keeps one
    update in hand at a time. ``capturable``: ``lr`` and ``weight_decay`` are 0-dim fp64 device
    tensors (``dmuon.numerics.device_scalars``; ``scalars``: their products, made once a step).
    ``oks``: each tensor's 0-dim device bool; where it does not hold, its momentum and the
    tensor keep their bits (its result is zeroed before the masked apply). A step without
    masks is this step with none."""
    momentum_(momentum_bufs, grads, momentum, foreach, oks)
    scalars = scalars or StepScalars()
    for i, (param, grad, buf) in enumerate(zip(params, grads, momentum_bufs)):
        ortho = orthogonalize(i, lookahead_copy(grad, buf, momentum, nesterov))
        ok = None if oks is None else [oks[i]]
        if ok is not None:
            mask_([ortho], ok, foreach)
        scale = update_scale(shapes[i], split_rows=split_rows, adjust_lr=adjust_lr,
                             matched_adamw_rms=matched_adamw_rms)
        with updating(param):
            apply_muon_([param], [ortho], lr=lr, weight_decay=weight_decay, scale=scale,
                        cautious_weight_decay=cautious_weight_decay, foreach=foreach, oks=ok, capturable=capturable,
                        scalars=scalars)


def muon_momentum_(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the momentum buffer in place; return the tensor to orthogonalize: the
    look-ahead cast to bf16 with a copy, so it never aliases ``buf`` and orthogonalizing it
    cannot corrupt momentum."""
    momentum_([buf], [grad], momentum, foreach=False)
    return lookahead_copy(grad, buf, momentum, nesterov)


def apply_muon_update_(param: torch.Tensor, ortho: torch.Tensor, lr: float | torch.Tensor, weight_decay: float,
                       scale: float, cautious_weight_decay: bool = False) -> None:
    """Decoupled weight decay with the unscaled ``lr`` (only where ``ortho`` and ``param``
    agree in sign with ``cautious_weight_decay``), then the scaled orthogonal step. A Tensor
    ``lr`` (one element, any shape) is used as torch.optim.Muon uses it, so the bits are
    torch's for that Tensor."""
    apply_muon_([param], [ortho], lr=lr, weight_decay=weight_decay, scale=scale,
                cautious_weight_decay=cautious_weight_decay)


def normuon_state(param: torch.Tensor) -> torch.Tensor:
    """NorMuon's state before its first step: zeros of shape
    ``normuon_second_moment_shape(param.shape)`` (one per matrix row), in fp32 (fp64
    for an fp64 parameter).

    For a DTensor parameter, a DTensor replicated on the parameter's mesh: every rank
    holds every row. The rows are few (1 / columns of the parameter), a whole matrix's
    rows are what its owner reads, and a replicated tensor reshards under DCP to any
    world size. ``dmuon.step.fast_path`` keeps the replicas equal after each step.
    """
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    shape = normuon_second_moment_shape(param.shape)
    if not isinstance(param, DTensor):
        return torch.zeros(shape, dtype=dtype, device=param.device)
    mesh = param.device_mesh
    local = torch.zeros(shape, dtype=dtype, device=param.to_local().device)
    if local.device.type != mesh.device_type:  # FSDP2's CPU offload: on the host, like the parameter
        return dtensor_where_it_is(local, mesh, (Replicate(),) * mesh.ndim)
    return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)


def adamw_state(param: torch.Tensor, device_step: bool | None = None) -> dict[str, torch.Tensor]:
    """A parameter's AdamW state before its first step, as torch.optim.AdamW makes it
    (``device_step``, for fused or capturable AdamW: the step counter in fp32 on the
    parameter's device, where those kernels read it; else on the host)."""
    on_device = torch.zeros((), dtype=torch.float32, device=param.device) if device_step else None
    step = torch.tensor(0.0, dtype=scalar_dtype()) if on_device is None else on_device
    return {
        "step": step,
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


def adamw_steps(states: Sequence[dict[str, torch.Tensor]], params: Sequence[torch.Tensor],
                device_step: bool | None) -> list[torch.Tensor]:
    """Each parameter's AdamW ``step`` counter, for a step whose kernel reads it on the
    device (``device_step``: fused or capturable) or not. Such a kernel reads it in fp32 on
    the parameter's device, where torch.optim.AdamW(fused=True) keeps it (and moves a loaded
    one): a counter made otherwise (a checkpoint of another implementation, an optimizer
    switched to fused) is moved there once, exactly."""
    if device_step:
        for state, param in zip(states, params):
            if state["step"].device != param.device or state["step"].dtype != torch.float32:
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
    return [state["step"] for state in states]
