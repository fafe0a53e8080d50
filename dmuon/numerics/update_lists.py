"""Muon's elementwise rules over lists of tensors, each written once: the momentum EMA
(:func:`momentum_`), the look-ahead (:func:`lookahead`), the decay (:func:`decay_`, its factor
made by :func:`decay_factor` only) and the apply, decay then scaled step (:func:`apply_muon_`).

Each rule is one function with one dispatch, as torch.optim's: ``foreach`` picks the list
form (one ``torch._foreach_*`` op per device and dtype signature, as torch.optim groups
them, so host work and kernel launches do not grow with the parameter count) or the
for-loop form (one op per tensor); inside each form, the same code serves

- **the mask** ``oks`` (each tensor's 0-dim bool on the device, ``dmuon.exchange.status_masks``):
  None, the rule as is; else exactly the rule's bits where ``ok`` holds and the tensor's own
  bits where it does not, without a host read (how: below);
- **the hyperparameters' form**: Python numbers; a one-element Tensor ``lr``, with
  torch.optim.Muon's own tensor arithmetic (per tensor, as torch steps it); or, under
  ``capturable``, 0-dim fp64 device tensors (``dmuon.numerics.device_scalars``), read only
  by kernels, with the bits of the same values as numbers.

Both forms give the same bits (``tests/test_update_lists.py``): a list op computes what its
per-tensor op computes, in the same opmath. Callers pass plain tensors (a DTensor's local
tensor): a list op on DTensors would pay DTensor's dispatch per op.

How the masked forms stay exact:

- momentum: the EMA computed out of place, then selected into the buffer
  (``dmuon.numerics.masked_updates.select_``): arithmetic with a zero weight would not do
  (``0 * NaN`` is NaN, ``-0.0 + 0.0`` is ``+0.0``); one chunk of at most
  :data:`MASKED_CHUNK_NUMEL` elements alive at a time;
- decay ``p = p * factor``: the factor is ``1 - lr * weight_decay`` or exactly 1 (``x * 1``
  is ``x``), in the dtype ``mul_`` by a number computes in (:func:`decay_factor`);
- the step ``p = p - lr * scale * O``: ``O`` is ``+0.0`` where masked
  (``dmuon.numerics.masked_updates.mask_``, on the owner, before it travels), and
  ``p + (-lr * scale) * (+0.0)`` adds ``-0.0``, which leaves every ``p`` as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.numerics.device_scalars import StepScalars, alpha_dtype, keep_of, opmath_dtype
from dmuon.numerics.masked_updates import by_mask, select_
from dmuon.numerics.update_rules import cautious_decay_, nesterov_lookahead
from dmuon.torch_compat import default_foreach

Tensors = Sequence[torch.Tensor]
Number = float | torch.Tensor
# Elements of the out-of-place momentum EMAs one list op computes before they are selected
# into their buffers (masked :func:`momentum_`): few launches, a bounded copy (64 MiB in fp32).
MASKED_CHUNK_NUMEL = 1 << 24


def resolve_foreach(foreach: bool | None, device: torch.device) -> bool:
    """``foreach`` as given, or for ``None`` torch's default for ``device`` (foreach on
    CUDA, per tensor on CPU), as torch.optim decides it."""
    return default_foreach(device) if foreach is None else foreach


def by_signature(*lists: Tensors) -> list[list[int]]:
    """Indices of the tensors whose entries in every list share device and dtype: the
    lists a foreach op takes its fast path on. In first-seen order."""
    dtypes = [[t.dtype for t in tensors] for tensors in lists]
    devices = [[t.device for t in tensors] for tensors in lists]
    if all(facts.count(facts[0]) == len(facts) for facts in (*dtypes, *devices) if facts):
        return [list(range(len(lists[0])))] if lists[0] else []  # the usual case, read without a key per tensor
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(*dtypes, *devices)):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


# ------------------------------------------------------------------------ momentum


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
    for chunk in _chunks(bufs, grads) if foreach else [[i] for i in range(len(bufs))]:
        news = (torch._foreach_lerp([bufs[i] for i in chunk], [grads[i] for i in chunk], 1 - momentum) if foreach
                else [bufs[chunk[0]].lerp(grads[chunk[0]], 1 - momentum)])
        select_([bufs[i] for i in chunk], [oks[i] for i in chunk], news, foreach)
        del news  # freed before the next chunk's are made: one chunk alive at a time


def _chunks(bufs: Tensors, grads: Tensors) -> list[list[int]]:
    """Indices of one device-and-dtype signature each, at most ``MASKED_CHUNK_NUMEL``
    elements a chunk (a larger tensor alone): the out-of-place EMAs alive at once."""
    return [[idx[k] for k in chunk] for idx in by_signature(bufs, grads)
            for chunk in bounded_chunks([bufs[i].numel() for i in idx], MASKED_CHUNK_NUMEL)]


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


def lookahead(grads: Tensors, bufs: Tensors, momentum: float, nesterov: bool, foreach: bool) -> list[torch.Tensor]:
    """:func:`~dmuon.numerics.update_rules.nesterov_lookahead` of every pair (after
    :func:`momentum_`): new tensors with Nesterov, the buffers themselves without."""
    if not (foreach and nesterov):
        return [nesterov_lookahead(grad, buf, momentum, nesterov) for grad, buf in zip(grads, bufs)]
    out: list[torch.Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for idx in by_signature(grads, bufs):
        for i, result in zip(idx, torch._foreach_lerp([grads[i] for i in idx], [bufs[i] for i in idx], momentum)):
            out[i] = result
    return out


# ------------------------------------------------------------------------- decay


def keep_factor(lr: Number, weight_decay: Number, scalars: StepScalars, capturable: bool = False) -> Number:
    """The decay's keep factor ``1 - lr * weight_decay`` (``device_scalars.keep_of``) as a rule
    reads it: a number, a Tensor ``lr``'s 0-dim tensor (torch.optim's one-element lr,
    squeezed), or under ``capturable`` the fp64 device value of the group's device
    hyperparameters, made once a step (``scalars``)."""
    if capturable:
        return scalars.keep(lr, weight_decay)
    return keep_of(lr.squeeze() if isinstance(lr, torch.Tensor) else lr, weight_decay)


def decay_factor(keep: Number, dtype: torch.dtype, scalars: StepScalars, ok: torch.Tensor | None = None,
                 capturable: bool = False, device: torch.device | None = None) -> tuple[torch.Tensor, bool]:
    """The one place a decay factor is made: ``keep`` (``1 - lr * weight_decay``) for a
    ``dtype`` tensor, exactly 1 where the 0-dim device bool ``ok`` does not hold, in the dtype
    ``mul_`` by a number computes in (fp32; fp64 for fp64); and whether to multiply by it as
    it is (else it is expanded for a tensor of another dtype, :func:`decay_`):

    - masked: made on ``ok``'s device (``StepScalars.masked``);
    - capturable: the fp64 device value, cast on the device (no host read);
    - a Tensor ``lr``'s: torch.optim.Muon's own value, multiplied by as it is;
    - a number: a 0-dim **CPU** tensor. ``_foreach_mul_`` by a plain number rounds it to the
      list's dtype on the CPU (0.998 -> 0.99609375 in bf16), and a 0-dim device tensor of
      another dtype is rounded to the tensor's on CUDA; a CPU scalar is read exactly by both
      (CUDA's multi-tensor kernel takes its value as an fp32 opmath number: one launch, no
      sync), and by ``mul_`` one tensor at a time.

    ``device``: the factor wanted there as a tensor (cautious decay's ``torch.where``)."""
    opmath = opmath_dtype(dtype)
    if ok is not None:
        return scalars.masked(keep, opmath, ok), False
    if capturable:
        return scalars.cast(keep, opmath), False
    if isinstance(keep, torch.Tensor):
        return keep if device is None else keep.to(device=device, dtype=opmath), True
    return (scalars.on_host(keep, opmath) if device is None else scalars.filled(keep, opmath, device)), True


def decay_(params: Tensors, keep: Number, foreach: bool, scalars: StepScalars, oks: Tensors | None = None,
           capturable: bool = False) -> None:
    """``p *= keep`` for every parameter, where its ``ok`` holds (``p *= 1`` elsewhere): one
    factor per mask and dtype (:func:`decay_factor`), expanded to a tensor of another dtype
    where it is a device tensor (read as the tensor's dtype otherwise); with ``foreach``, one
    list op per mask, dtype and device (the Tensor form, one kernel on CUDA, where the
    factor is the list's dtype or read as a scalar)."""
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


# ------------------------------------------------------------------------- apply


def apply_muon_(params: Tensors, orthos: Tensors, *, lr: Number, weight_decay: Number, scale: float,
                cautious_weight_decay: bool = False, foreach: bool = False, oks: Tensors | None = None,
                capturable: bool = False, scalars: StepScalars | None = None) -> None:
    """Muon's apply for every pair (``params`` of one group and one shape scale): the decay
    ``p *= 1 - lr * weight_decay`` (with ``cautious_weight_decay`` only where ``ortho`` and
    ``p`` agree in sign), then the step ``p += -lr * scale * ortho``. ``oks``: only where each
    ``ok`` holds, ``orthos`` already ``+0.0`` elsewhere (module docstring). ``capturable``:
    ``lr`` and ``weight_decay`` are 0-dim fp64 device tensors, read by kernels only; the decay
    then runs even at 0 (the host cannot look: a product by exactly 1 keeps every bit).
    ``scalars``: the step's products of them, made once a step."""
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
    if capturable:
        _scaled_add_(params, orthos, scalars.alpha(lr, scale), foreach, scalars)
    else:
        alpha = -lr * scale  # a number, or a 0-dim tensor (a Tensor lr)
        for idx in by_signature(params, orthos):
            ps, us = [params[i] for i in idx], [orthos[i] for i in idx]
            if _add_rounds_by_position(ps[0], us[0]):
                alpha_tensor = alpha if isinstance(alpha, torch.Tensor) else scalars.on_host(alpha, torch.float64)
                _scaled_add_(ps, us, alpha_tensor, foreach, scalars)
            elif foreach and not _off_the_route(ps, us):
                torch._foreach_add_(ps, us, alpha=alpha)
            else:
                for param, ortho in zip(ps, us):
                    param.add_(ortho, alpha=alpha)


def _off_the_route(targets: Tensors, updates: Tensors) -> bool:
    """Whether an accelerator would run a list op of these pairs one tensor at a time: updates
    of another dtype than their targets (a bf16 result kept whole on its owner, applied to an
    fp32 weight as soon as it is orthogonalized, a list of one), where torch's multi-tensor
    route wants one dtype. The apply then makes those per-tensor calls itself: the same
    kernels and bits, and no list op off the route. On the CPU a list op loops anyway, in one
    dispatch (fewer host ops)."""
    return targets[0].device.type != "cpu" and updates[0].dtype != targets[0].dtype


def _add_rounds_by_position(target: torch.Tensor, update: torch.Tensor) -> bool:
    """Whether ``target.add_(update, alpha=a)`` gives bits that depend on where an element sits
    in the tensor: on the CPU, a bf16 or fp16 target with an update of its dtype. Both of its
    loops read ``a`` rounded to that dtype, but the vector loop computes ``target + a * update``
    in fp32 and rounds once, while the scalar loop over the last ``numel % (2 * vector width)``
    elements (``cpu_kernel_vec``'s remainder) rounds ``a * update`` to the dtype first. A row
    shard puts other elements in that remainder than the whole matrix does, so the update of a
    shard would not be the whole matrix's block. ``_scaled_add_`` gives the vector loop's bits
    at every position (``addcmul_`` by ``a`` in the target's dtype, computed in fp32: the
    product of two bf16 or fp16 values is exact there)."""
    return (target.device.type == "cpu" and target.dtype in (torch.bfloat16, torch.float16)
            and update.dtype == target.dtype)


def _scaled_add_(targets: Tensors, updates: Tensors, alpha: torch.Tensor, foreach: bool,
                 scalars: StepScalars) -> None:
    """``target += alpha * update``, ``alpha`` a 0-dim fp64 device tensor, with the bits of
    ``target.add_(update, alpha=float(alpha))``: ``addcmul_`` (``value`` 1) of ``update`` and
    ``alpha`` in the dtype ``add_`` reads its ``alpha`` in (``device_scalars.alpha_dtype``).

    With ``foreach``, one list op per device and dtype. Where that dtype is the list's own
    (fp32 and fp64 parameters; on the CPU every dtype), ``alpha`` goes in unexpanded, as
    ``tensor1``, a list of the one 0-dim tensor: CUDA's one-kernel form for it
    (``ForeachPointwiseOp.cu``: ``PointwiseOpScalar0dTensorFunctor``, which computes
    ``std::fma(alpha, update, target)`` at ``value`` 1, ``DeviceAddCmulCdiv.cuh``; the
    contracted ``self + alpha * other`` of ``add_``; torch 2.11 to 2.15 alike). Elsewhere
    (bf16 or fp16 on CUDA, whose ``add_`` keeps ``alpha`` in fp32) that form would round
    ``alpha`` to the list's dtype: ``alpha`` goes in broadcast instead (not dense: torch
    runs one kernel per tensor, with ``add_``'s bits). Pairs :func:`_off_the_route` go per
    tensor."""
    for idx in by_signature(targets, updates):
        ts, us = [targets[i] for i in idx], [updates[i] for i in idx]
        scale = scalars.cast(alpha, alpha_dtype(ts[0].dtype, ts[0].device.type))
        if not foreach or _off_the_route(ts, us):
            for target, update in zip(ts, us):
                target.addcmul_(update, scale.expand(update.shape))
        elif scale.dtype == ts[0].dtype:
            torch._foreach_addcmul_(ts, [scale] * len(ts), us)
        else:
            torch._foreach_addcmul_(ts, us, [scale.expand(u.shape) for u in us])
