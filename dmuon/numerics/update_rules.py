"""Muon's update, each line one function over lists of tensors (AdamW's:
``dmuon.numerics.adamw_rules``).

Muon, for a matrix W (A x B) with gradient G (torch.optim.Muon semantics)::

    buf = lerp(buf, G, 1 - momentum)                   # momentum_
    U   = lerp(G, buf, momentum) if nesterov else buf  # lookahead, then compute_copy (bf16)
    O   = orthogonalize(U)                             # orthogonalize_update (+ NorMuon)
    W   = W * (1 - lr * weight_decay)                  # decay_ (in apply_muon_), unscaled lr
    W   = W - lr * shape_scale(A, B) * O               # apply_muon_

Every line but ``orthogonalize`` is elementwise, so a row shard gets the whole matrix's bits:
the distributed step keeps momentum and the apply on the local shards and moves only U and O.

Each rule has one dispatch, as torch.optim's: ``foreach`` picks the list form (one
``torch._foreach_*`` op per device and dtype signature) or one op per tensor, the same
bits (``tests/test_update_lists.py``); callers pass plain tensors (a DTensor's local
tensor). Inside each:

- the mask ``oks`` (each tensor's 0-dim device bool, ``dmuon.exchange.status_masks``): the rule's
  bits where it holds, the tensor's own elsewhere, with no host read. Momentum: the EMA made out
  of place and selected (``0 * NaN`` is NaN), :data:`MASKED_CHUNK_NUMEL` at a time; decay: a
  factor of exactly 1; the step: ``O`` is ``+0.0`` where masked, and ``p + (-a) * (+0.0)`` is ``p``;
- the hyperparameters: numbers; a one-element Tensor ``lr`` (torch.optim.Muon's arithmetic, per
  tensor); or under ``capturable`` 0-dim fp64 device tensors
  (``dmuon.numerics.device_scalars``) whose products, made on the device once a step
  (``device_scalars.StepScalars``), are the host's numbers.

NorMuon (arXiv 2510.05491, :func:`normuon_normalize_`) reads whole rows, so it runs where ``O`` is
whole (the owner); cautious weight decay (arXiv 2510.12402, :func:`cautious_decay_`) is elementwise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from dmuon.numerics.device_scalars import StepScalars
from dmuon.numerics.masked_updates import by_mask, select_
from dmuon.numerics.newton_schulz import UPDATE_DTYPE, matrix_shape, orthogonalize, orthogonalize_row_blocks
from dmuon.numerics.standard_iteration import NewtonSchulzBuffers
from dmuon.torch_compat import default_foreach, dtensor_where_it_is

Tensors = Sequence[torch.Tensor]
Number = float | torch.Tensor
# Shape-aware learning-rate scales (``DMuon(adjust_lr=...)``).
ADJUST_LR_CHOICES = ("original", "match_rms_adamw", "spectral", None)
# Moonlight's choice: Muon's update RMS matched to a typical AdamW update RMS of 0.2.
DEFAULT_MATCHED_ADAMW_RMS = 0.2
# NorMuon's per-row EMA coefficient and the guard on its root and norm (official
# normuon.py: 0.95, 1e-10).
DEFAULT_NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-10
# Elements of the out-of-place EMAs a masked momentum_ holds at once (64 MiB in fp32).
MASKED_CHUNK_NUMEL = 1 << 24


def resolve_foreach(foreach: bool | None, device: torch.device) -> bool:
    """``foreach`` as given, or for ``None`` torch.optim's default for ``device`` (CUDA:
    yes, CPU: no)."""
    return default_foreach(device) if foreach is None else foreach


def by_signature(*lists: Tensors) -> list[list[int]]:
    """Indices of the tensors whose entries in every list share device and dtype (a list op's
    fast path), in first-seen order."""
    dtypes = [[t.dtype for t in tensors] for tensors in lists]
    devices = [[t.device for t in tensors] for tensors in lists]
    if all(facts.count(facts[0]) == len(facts) for facts in (*dtypes, *devices) if facts):
        return [list(range(len(lists[0])))] if lists[0] else []  # the usual case, read without a key per tensor
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(*dtypes, *devices)):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def bounded_chunks(numels: Sequence[int], limit: int) -> list[list[int]]:
    """Positions of ``numels`` in order, cut into runs of at most ``limit`` elements (a larger
    one alone; an empty one joins the run it comes in, or opens the first)."""
    chunks: list[list[int]] = []
    size = 0
    for i, numel in enumerate(numels):
        if not chunks or (chunks[-1] and size + numel > limit):
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += numel
    return chunks


def alpha_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype ``add_(other, alpha=a)`` on a ``dtype`` tensor reads ``a`` in: fp64 for fp64; on
    the CPU a bf16 or fp16 tensor's own dtype; else fp32 (CUDA's opmath)."""
    if dtype == torch.float64:
        return torch.float64
    if device_type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.float32


def momentum_(bufs: Tensors, grads: Tensors, momentum: float, foreach: bool, oks: Tensors | None = None) -> None:
    """``buf = lerp(buf, grad, 1 - momentum)`` for every pair, in place; with ``oks``, only
    where each ``ok`` holds (``buf`` keeps its bits elsewhere, whatever ``grad`` holds)."""
    if oks is None:
        if not foreach:
            for buf, grad in zip(bufs, grads):
                buf.lerp_(grad, 1 - momentum)
            return
        for idx in by_signature(bufs, grads):
            torch._foreach_lerp_([bufs[i] for i in idx], [grads[i] for i in idx], 1 - momentum)
        return
    chunks = ([[idx[k] for k in chunk] for idx in by_signature(bufs, grads)
               for chunk in bounded_chunks([bufs[i].numel() for i in idx], MASKED_CHUNK_NUMEL)]
              if foreach else [[i] for i in range(len(bufs))])
    for chunk in chunks:
        news = (torch._foreach_lerp([bufs[i] for i in chunk], [grads[i] for i in chunk], 1 - momentum) if foreach
                else [bufs[chunk[0]].lerp(grads[chunk[0]], 1 - momentum)])
        select_([bufs[i] for i in chunk], [oks[i] for i in chunk], news, foreach)
        del news  # freed before the next chunk's are made: one chunk alive at a time


def lookahead(grads: Tensors, bufs: Tensors, momentum: float, nesterov: bool, foreach: bool) -> list[torch.Tensor]:
    """What Muon orthogonalizes, in the parameters' dtype, after :func:`momentum_`: with
    Nesterov ``lerp(grad, buf, momentum)`` (new tensors), else the buffers themselves."""
    if not (foreach and nesterov):
        return [grad.lerp(buf, momentum) if nesterov else buf for grad, buf in zip(grads, bufs)]
    out: list[torch.Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for idx in by_signature(grads, bufs):
        for i, result in zip(idx, torch._foreach_lerp([grads[i] for i in idx], [bufs[i] for i in idx], momentum)):
            out[i] = result
    return out


def compute_copy(lookahead: torch.Tensor) -> torch.Tensor:
    """The look-ahead as Newton-Schulz reads it: a bf16 copy, so it never aliases the momentum
    (without Nesterov the look-ahead is the buffer) and orthogonalizing it cannot touch it."""
    return lookahead.to(UPDATE_DTYPE, copy=True)


def orthogonalize_update(update: torch.Tensor, group: dict[str, Any], ns_dtype: torch.dtype, ns_algorithm: str,
                         second_moment: torch.Tensor | None = None, ok: torch.Tensor | None = None,
                         buffers: NewtonSchulzBuffers | None = None) -> torch.Tensor:
    """Newton-Schulz of an update (or a unit of it) with ``group``'s settings, per matrix, expert or
    block of ``split_rows`` rows, then NorMuon's :func:`normuon_normalize_` in a NorMuon group: a
    new bf16 tensor of ``update``'s shape (``buffers``: ``dmuon.numerics.standard_iteration``)."""
    shape, split_rows = matrix_shape(update.shape), group["split_rows"]
    matrix = update if update.shape == shape else update.view(shape)  # a view is an op: only when needed
    settings = (group["ns_coefficients"], group["ns_steps"], group["eps"], ns_dtype)
    gram = dict(algorithm=ns_algorithm, restarts=group["ns_gram_restarts"], buffers=buffers)
    if split_rows:
        ortho = orthogonalize_row_blocks(matrix, split_rows, *settings, **gram)
    else:
        ortho = orthogonalize(matrix, *settings, **gram)
    ortho = ortho if ortho.shape == update.shape else ortho.view(update.shape)
    if not group["normuon"]:
        return ortho
    if buffers is not None:  # its fp32 copies come next: freed first, the peak stays one matrix's
        buffers.release()
    return normuon_normalize_(ortho, second_moment, group["normuon_beta2"], split_rows, ok)


def normuon_normalize_(ortho: torch.Tensor, second_moment: torch.Tensor, beta2: float, split_rows: int | None = None,
                       ok: torch.Tensor | None = None) -> torch.Tensor:
    """NorMuon's normalization of ``ortho``, a new bf16 tensor; ``second_moment``
    (``[..., rows, 1]``) updated in place. Per matrix ``O`` (expert, block of ``split_rows``
    rows), in fp32, as normuon.py::

        v = lerp(v, mean(O * O, dim=-1), 1 - beta2)    # per-row EMA, no bias correction
        N = O * (1 / (sqrt(v) + 1e-10))
        N = N * (||O||_F / (||N||_F + 1e-10))          # keep O's Frobenius norm

    ``ok`` (0-dim device bool): where False, ``v`` keeps its bits (the EMA selected by
    ``torch.where``)."""
    shape = matrix_shape(ortho.shape)
    rows = split_rows if split_rows and len(shape) == 2 else shape[-2]
    matrices = ortho.reshape(-1, rows, shape[-1])
    moments = second_moment.view(matrices.shape[0], rows, 1)
    out = torch.empty(matrices.shape, dtype=UPDATE_DTYPE, device=ortho.device)
    for k in range(matrices.shape[0]):
        o = matrices[k].to(moments.dtype, copy=True)
        norm = torch.linalg.vector_norm(o)
        if ok is None:
            moments[k].lerp_((o * o).mean(dim=-1, keepdim=True), 1 - beta2)
        else:
            torch.where(ok, moments[k].lerp((o * o).mean(dim=-1, keepdim=True), 1 - beta2), moments[k],
                        out=moments[k])
        normalized = o.mul_(moments[k].sqrt().add_(NORMUON_EPS).reciprocal_())
        normalized.mul_(norm / torch.linalg.vector_norm(normalized).add_(NORMUON_EPS))
        out[k].copy_(normalized)
    return out.view(ortho.shape)


def normuon_state(param: torch.Tensor) -> torch.Tensor:
    """NorMuon's state before its first step: zeros, one per row of the matrices Newton-Schulz
    sees (``[A, 1]``, ``[E, A, 1]``), in fp32 (fp64 for fp64). For a DTensor, replicated on its
    mesh (the rows are few; ``dmuon.step.fast_path`` keeps the replicas equal)."""
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    shape = (*matrix_shape(param.shape)[:-1], 1)
    if not isinstance(param, DTensor):
        return torch.zeros(shape, dtype=dtype, device=param.device)
    mesh = param.device_mesh
    local = torch.zeros(shape, dtype=dtype, device=param.to_local().device)
    if local.device.type != mesh.device_type:  # FSDP2's CPU offload: on the host, like the parameter
        return dtensor_where_it_is(local, mesh, (Replicate(),) * mesh.ndim)
    return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)


@functools.lru_cache(maxsize=None)  # a number per shape and setting: made once, not per tensor a step
def shape_scale(shape: Sequence[int], adjust_lr: str | None, matched_adamw_rms: float,
                split_rows: int | None = None) -> float:
    """The factor on ``lr`` for the update of a parameter of ``shape``, with ``A x B`` the matrix
    Newton-Schulz sees (one expert; one block of ``split_rows`` rows): ``"original"``
    (torch.optim.Muon's) ``sqrt(max(1, A / B))``; ``"match_rms_adamw"`` (Moonlight)
    ``matched_adamw_rms * sqrt(max(A, B))``; ``"spectral"`` ``sqrt(A / B)``; ``None`` 1."""
    rows, cols = matrix_shape((split_rows, shape[1]) if split_rows else shape)[-2:]
    if adjust_lr == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return matched_adamw_rms * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":
        return math.sqrt(rows / cols)
    if adjust_lr is None:
        return 1.0
    raise ValueError(f"unknown adjust_lr {adjust_lr!r}; expected one of {ADJUST_LR_CHOICES}")


def keep_factor(lr: Number, weight_decay: Number, scalars: StepScalars, capturable: bool = False) -> Number:
    """The decay's keep factor ``1 - lr * weight_decay``: of numbers, of a Tensor ``lr``'s
    0-dim tensor (torch.optim's one-element lr), or under ``capturable`` of the device
    values, made once."""
    if capturable:
        return scalars.keep(lr, weight_decay)
    return 1 - (lr.squeeze() if isinstance(lr, torch.Tensor) else lr) * weight_decay


def decay_factor(keep: Number, dtype: torch.dtype, scalars: StepScalars, ok: torch.Tensor | None = None,
                 capturable: bool = False, device: torch.device | None = None) -> tuple[torch.Tensor, bool]:
    """The decay factor of a ``dtype`` tensor: ``keep``, exactly 1 where ``ok`` does not hold, in
    the dtype ``mul_`` by a number computes in (fp32; fp64 for fp64); and whether it multiplies
    as it is (else expanded for a tensor of another dtype). ``device``: wanted there as a tensor."""
    opmath = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
    if ok is not None:
        return scalars.masked(keep, opmath, ok), False
    if capturable:  # the fp64 device value, cast on the device: no host read
        return scalars.cast(keep, opmath), False
    if isinstance(keep, torch.Tensor):  # a Tensor lr's: torch.optim.Muon's own value
        return keep if device is None else keep.to(device=device, dtype=opmath), True
    # A 0-dim CPU scalar: _foreach_mul_ by a number rounds it to a bf16 list's dtype on the CPU, a
    # device tensor is rounded to the list's dtype on CUDA; both kernels read a CPU scalar exactly.
    return (scalars.on_host(keep, opmath) if device is None else scalars.filled(keep, opmath, device)), True


def decay_(params: Tensors, keep: Number, foreach: bool, scalars: StepScalars, oks: Tensors | None = None,
           capturable: bool = False) -> None:
    """``p *= keep`` for every parameter where its ``ok`` holds (``p *= 1`` elsewhere): one
    factor per mask and dtype (:func:`decay_factor`); with ``foreach``, one list op per mask,
    dtype and device."""
    for ok, idx in by_mask(oks) if oks is not None else [(None, range(len(params)))]:
        lists: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for i in idx:
            lists.setdefault((params[i].dtype, params[i].device), []).append(params[i])
        for (dtype, _), targets in lists.items():
            factor, as_scalar = decay_factor(keep, dtype, scalars, ok, capturable)
            one = as_scalar or factor.dtype == dtype
            if foreach:
                torch._foreach_mul_(targets, factor if one else [factor.expand(t.shape) for t in targets])
                continue
            for target in targets:
                target.mul_(factor if one else factor.expand(target.shape))


def cautious_mask(update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Where cautious weight decay applies: ``update * param >= 0`` (a zero on either side
    agrees), read from the signs so a product too small for the dtype cannot flip it; NaN: False."""
    return torch.sign(update) * torch.sign(param) >= 0


def cautious_decay_(param: torch.Tensor, update: torch.Tensor, factor: torch.Tensor) -> None:
    """Decoupled weight decay only where ``update`` and ``param`` agree in sign (arXiv
    2510.12402, Algorithm 1): ``param *= factor`` (0-dim, :func:`decay_factor`'s) there."""
    one = torch.ones((), dtype=factor.dtype, device=param.device)
    param.mul_(torch.where(cautious_mask(update, param), factor, one))


def apply_muon_(params: Tensors, orthos: Tensors, *, lr: Number, weight_decay: Number, scale: float,
                cautious_weight_decay: bool = False, foreach: bool = False, oks: Tensors | None = None,
                capturable: bool = False, scalars: StepScalars | None = None) -> None:
    """Muon's apply for every pair (``params`` of one group and one shape scale): the decay
    ``p *= 1 - lr * weight_decay`` (cautious: only where ``ortho`` and ``p`` agree in sign), then
    ``p += -lr * scale * ortho``. ``oks``: only where each holds, ``orthos`` already ``+0.0``
    elsewhere. ``capturable``: the decay runs even at 0 (``x * 1`` keeps every bit)."""
    if not params:
        return
    scalars = scalars or StepScalars()
    if isinstance(lr, torch.Tensor) and not capturable:  # torch.optim.Muon's arithmetic, per tensor
        lr, foreach = lr.squeeze(), False
    keep = keep_factor(lr, weight_decay, scalars, capturable)
    if cautious_weight_decay:  # its mask is a torch.where per tensor
        for i, (param, ortho) in enumerate(zip(params, orthos)):
            ok = None if oks is None else oks[i]
            cautious_decay_(param, ortho, decay_factor(keep, param.dtype, scalars, ok, capturable, param.device)[0])
    elif capturable or weight_decay != 0:  # x * 1.0 is x: skipping the op keeps the bits (masked or not)
        decay_(params, keep, foreach, scalars, oks, capturable)
    alpha = scalars.alpha(lr, scale) if capturable else -lr * scale  # a number or a 0-dim tensor
    for idx in by_signature(params, orthos):
        ps, us = [params[i] for i in idx], [orthos[i] for i in idx]
        # An accelerator's list op of mixed dtypes goes per tensor: do it here, same kernels.
        per_tensor = not foreach or (ps[0].device.type != "cpu" and us[0].dtype != ps[0].dtype)
        # CPU bf16/fp16 add_ rounds alpha * update in its remainder loop only: bits a row shard
        # cannot give. addcmul_ gives the vector loop's everywhere, as capturable's fp64 alpha does.
        if not (capturable or (ps[0].device.type == "cpu" and ps[0].dtype in (torch.bfloat16, torch.float16)
                               and us[0].dtype == ps[0].dtype)):
            if per_tensor:
                for param, ortho in zip(ps, us):
                    param.add_(ortho, alpha=alpha)
            else:
                torch._foreach_add_(ps, us, alpha=alpha)
            continue
        alpha_t = scalars.cast(alpha if isinstance(alpha, torch.Tensor) else scalars.on_host(alpha, torch.float64),
                               alpha_dtype(ps[0].dtype, ps[0].device.type))
        if per_tensor:
            for param, ortho in zip(ps, us):
                param.addcmul_(ortho, alpha_t.expand(ortho.shape))
        elif alpha_t.dtype == ps[0].dtype:  # CUDA's one-kernel 0-dim form, fma(alpha, u, p) as add_'s
            torch._foreach_addcmul_(ps, [alpha_t] * len(ps), us)
        else:  # bf16/fp16 on CUDA: the 0-dim form would round alpha to the list's dtype; broadcast
            torch._foreach_addcmul_(ps, us, [alpha_t.expand(u.shape) for u in us])
