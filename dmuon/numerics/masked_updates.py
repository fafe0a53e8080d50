"""The elementwise rules of ``dmuon.numerics.update_lists`` under a device mask: each
parameter ``j`` has a 0-dim bool ``ok[j]`` on the device; where it is True the rule
gives exactly the bits of the unmasked rule, where it is False the tensor keeps its bits,
``-0.0`` and inf included; a state tensor's NaN keeps its bits too, a parameter's NaN stays
NaN (the decay's product by exactly 1 may quiet its payload, e.g. on bf16 CPU tensors).

Why a mask and not a host branch: the distributed step runs the same ops on every rank
whatever its grads (``dmuon.exchange.grad_status``), and whether a rank may apply a
parameter's update is known only on the device, after the ranks' status is summed. So the
mask is read by the kernels and never by the host.

How each rule stays exact:

- momentum: the unmasked rule computed out of place (``lerp`` by the number), then
  selected with ``torch.where`` into the buffer: arithmetic with a zero weight would not
  do (``0 * NaN`` is NaN, ``-0.0 + 0.0`` is ``+0.0``, ``inf - inf`` is NaN);
- results (:func:`mask_`): selected against ``+0.0`` with ``torch.where`` (a NaN result
  of a masked matrix is dropped, not multiplied by 0);
- decay ``p = p * keep``: the factor is ``keep`` or exactly 1 (``x * 1`` is ``x`` for
  every ``x``), in the dtype ``mul_`` by a number computes in: a 0-dim tensor for fp32
  and fp64 ``p`` (its own dtype), expanded to ``p``'s shape for narrower ones, which every
  device then multiplies in fp32 (a 0-dim device tensor of another dtype would be
  rounded to ``p``'s dtype on CUDA);
- the step ``p = p - lr * scale * O``: ``O`` is ``+0.0`` where masked (:func:`mask_`, on
  the owner, before it travels), and ``p + (-lr * scale) * (+0.0)`` adds ``-0.0``, which
  leaves every ``p`` as it is.

``foreach=False`` (torch's "for-loop") runs every rule per tensor, with the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.numerics.device_scalars import StepScalars, decay_, opmath_dtype, scaled_add_
from dmuon.numerics.update_lists import by_signature
from dmuon.numerics.update_rules import cautious_decay_

Tensors = Sequence[torch.Tensor]
# Elements of the out-of-place momentum EMAs one list op computes before they are selected
# into their buffers (``masked_momentum_``): few launches, a bounded copy (64 MiB in fp32).
MASKED_CHUNK_NUMEL = 1 << 24


def where_ok(ok: torch.Tensor, value: float | torch.Tensor, otherwise: float, dtype: torch.dtype) -> torch.Tensor:
    """``value`` where ``ok`` else ``otherwise``, elementwise over the bool vector ``ok``,
    in ``dtype``, filled on ``ok``'s device (no copy from the host)."""
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=dtype, device=ok.device)
    return torch.where(ok, value.to(device=ok.device, dtype=dtype),
                       torch.full((), otherwise, dtype=dtype, device=ok.device))


def select_(target: torch.Tensor, ok: torch.Tensor, new: torch.Tensor) -> None:
    """``target = new`` where the 0-dim bool ``ok`` holds, ``target`` unchanged (its bits) elsewhere."""
    torch.where(ok, new, target, out=target)


def masked_momentum_(bufs: Tensors, grads: Tensors, momentum: float, oks: Tensors, foreach: bool = False) -> None:
    """``buf = lerp(buf, grad, 1 - momentum)`` where ``oks[i]``; ``buf`` keeps its bits
    elsewhere, whatever ``grad`` holds. With ``foreach``, the EMAs are computed by one list
    op per chunk of at most ``MASKED_CHUNK_NUMEL`` elements (or one tensor), each selected
    into its buffer after; else one buffer's copy at a time."""
    for chunk in _chunks(bufs, grads) if foreach else [[i] for i in range(len(bufs))]:
        news = (torch._foreach_lerp([bufs[i] for i in chunk], [grads[i] for i in chunk], 1 - momentum) if foreach
                else [bufs[chunk[0]].lerp(grads[chunk[0]], 1 - momentum)])
        for i, new in zip(chunk, news):
            select_(bufs[i], oks[i], new)
        del news, new  # freed before the next chunk's are made: one chunk alive at a time


def _chunks(bufs: Tensors, grads: Tensors) -> list[list[int]]:
    """Indices of one device-and-dtype signature each, at most ``MASKED_CHUNK_NUMEL``
    elements a chunk (a larger tensor alone): the out-of-place EMAs alive at once."""
    chunks: list[list[int]] = []
    for idx in by_signature(bufs, grads):
        size = MASKED_CHUNK_NUMEL
        for i in idx:
            if size + bufs[i].numel() > MASKED_CHUNK_NUMEL:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += bufs[i].numel()
    return chunks


def mask_(tensors: Tensors, oks: Tensors) -> None:
    """Set each tensor to ``+0.0`` where its ``ok`` is False (results before they travel
    back), whatever it holds (NaN included); unchanged where True."""
    zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    for tensor, ok in zip(tensors, oks):
        key = (tensor.dtype, tensor.device)
        if key not in zeros:
            zeros[key] = torch.zeros((), dtype=tensor.dtype, device=tensor.device)
        torch.where(ok, tensor, zeros[key], out=tensor)


def decay_factors(keep: float | torch.Tensor, oks: Tensors | None, like: Tensors,
                  scalars: StepScalars | None = None) -> list[torch.Tensor]:
    """Each tensor's decay factor: ``keep`` where ``ok`` else 1, in the dtype ``mul_`` by
    a number computes in for that tensor, expanded to its shape (see the module docstring)."""
    # A 0-dim factor of the tensor's own dtype is read exactly (fp32, fp64): no view needed.
    return [factor if factor.dtype == t.dtype else factor.expand(t.shape)
            for factor, t in zip(scalar_decay_factors(keep, oks, like, scalars), like)]


def scalar_decay_factors(keep: float | torch.Tensor, oks: Tensors | None, like: Tensors,
                         scalars: StepScalars | None = None) -> list[torch.Tensor]:
    """:func:`decay_factors` as 0-dim tensors (for :func:`cautious_decay_`'s ``keep``);
    ``oks`` None: ``keep`` everywhere (a device ``keep``, cast on the device, once a step
    with the step's ``scalars``)."""
    if not like:
        return []
    dtypes = {opmath_dtype(t.dtype) for t in like}
    if oks is None:
        assert isinstance(keep, torch.Tensor), "unmasked factors are made here for a device keep only"
        scalars = scalars or StepScalars()
        return [scalars.cast(keep, opmath_dtype(t.dtype)) for t in like]
    ok = torch.stack(list(oks))
    by_dtype = {dtype: where_ok(ok, keep, 1.0, dtype).unbind() for dtype in dtypes}
    return [by_dtype[opmath_dtype(t.dtype)][i] for i, t in enumerate(like)]


def masked_apply_(params: Tensors, orthos: Tensors, oks: Tensors, lr: float | torch.Tensor,
                  weight_decay: float | torch.Tensor, scale: float, cautious_weight_decay: bool, foreach: bool,
                  capturable: bool = False, scalars: StepScalars | None = None) -> None:
    """``dmuon.numerics.update_lists.apply_muon_updates_`` where ``ok``, nothing elsewhere:
    the decay's factor is masked here, and ``orthos`` must already be ``+0.0`` where not
    ``ok`` (:func:`mask_`), so the scaled step adds ``-0.0`` there. ``capturable``: ``lr``
    and ``weight_decay`` are device hyperparameters (:func:`device_apply_`)."""
    if not params:
        return
    if capturable:
        device_apply_(params, orthos, oks, lr, weight_decay, scale, cautious_weight_decay, foreach, scalars)
        return
    if isinstance(lr, torch.Tensor):
        lr = lr.squeeze()
    keep = 1 - lr * weight_decay
    if cautious_weight_decay:
        for param, ortho, factor in zip(params, orthos, scalar_decay_factors(keep, oks, params)):
            cautious_decay_(param, ortho, lr, weight_decay, keep=factor)
    elif weight_decay != 0 and foreach:
        torch._foreach_mul_(list(params), decay_factors(keep, oks, params))
    elif weight_decay != 0:
        for param, factor in zip(params, decay_factors(keep, oks, params)):
            param.mul_(factor)
    if foreach and not isinstance(lr, torch.Tensor):
        for idx in by_signature(params, orthos):
            torch._foreach_add_([params[i] for i in idx], [orthos[i] for i in idx], alpha=-lr * scale)
        return
    for param, ortho in zip(params, orthos):
        param.add_(ortho, alpha=-lr * scale)


def device_apply_(params: Tensors, orthos: Tensors, oks: Tensors | None, lr: torch.Tensor,
                  weight_decay: torch.Tensor, scale: float, cautious_weight_decay: bool, foreach: bool,
                  scalars: StepScalars | None = None) -> None:
    """The decay and the scaled step with ``lr`` and ``weight_decay`` as 0-dim fp64 device
    tensors (``capturable``, ``dmuon.numerics.device_scalars``): the bits of
    ``apply_muon_updates_`` / :func:`masked_apply_` with those values as numbers (``oks``
    None: unmasked), and no host read. The decay runs even at ``weight_decay`` 0 (the host
    cannot look): a product by exactly 1 keeps every bit. ``scalars``: the step's products,
    made once a step (``dmuon.numerics.device_scalars.StepScalars``)."""
    scalars = scalars or StepScalars()
    keep = scalars.keep(lr, weight_decay)
    if cautious_weight_decay:
        for param, ortho, factor in zip(params, orthos, scalar_decay_factors(keep, oks, params, scalars)):
            cautious_decay_(param, ortho, lr, weight_decay, keep=factor)
    elif oks is None:
        decay_(params, keep, foreach, scalars)
    elif foreach:
        torch._foreach_mul_(list(params), decay_factors(keep, oks, params, scalars))
    else:
        for param, factor in zip(params, decay_factors(keep, oks, params, scalars)):
            param.mul_(factor)
    scaled_add_(params, orthos, scalars.alpha(lr, scale), foreach, scalars)


class UnitMasks:
    """One step's parameter masks read per unit (``param_of_unit``: each unit's parameter)."""

    def __init__(self, ok: Sequence[torch.Tensor], param_of_unit: Sequence[int]) -> None:
        self.ok, self.param_of_unit = ok, param_of_unit

    def zero_masked(self, units: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """Set the results of ``units`` to ``+0.0`` where their parameter's mask is False, in
        place (on the owner, before they travel back)."""
        mask_(results, [self.ok[self.param_of_unit[i]] for i in units])
