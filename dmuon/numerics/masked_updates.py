"""The elementwise rules of ``dmuon.numerics.update_lists`` under a device mask: each
parameter ``j`` has a 0-dim bool ``ok[j]`` on the device; where it is True the rule
gives exactly the bits of the unmasked rule, where it is False the tensor keeps its bits,
``-0.0`` and inf included; a state tensor's NaN keeps its bits too, a parameter's NaN stays
NaN (the decay's product by exactly 1 may quiet its payload, e.g. on bf16 CPU tensors).

Why a mask and not a host branch: the distributed step runs the same ops on every rank
whatever its grads (``dmuon.exchange.grad_status``), and whether a rank may apply a
parameter's update is known only on the device, after the ranks' status is summed. So the
mask is read by the kernels and never by the host.

A step has few distinct masks (``dmuon.exchange.status_masks``: the step's own, shared by
every parameter with a grad, and a False one for those without), so every rule runs one
list op per distinct mask (by identity), not one op per tensor.

How each rule stays exact:

- momentum: the unmasked rule computed out of place (``lerp`` by the number), then
  selected into the buffer (:func:`select_`): arithmetic with a zero weight would not
  do (``0 * NaN`` is NaN, ``-0.0 + 0.0`` is ``+0.0``, ``inf - inf`` is NaN);
- results (:func:`mask_`): selected against ``+0.0`` (a NaN result of a masked matrix is
  dropped, not multiplied by 0);
- a select is exact arithmetic on the tensors' bits seen as integers of their width,
  ``target = target * (1 - m) + new * m`` with ``m`` 0 or 1 (each product is the value or
  0, so the sum never overflows): with ``foreach``, three list ops per mask and width on
  CUDA, where a list op is one multi-tensor kernel; on the CPU, where a list op loops over
  its tensors, and without ``foreach``, one ``torch.where`` per tensor (cheaper on the
  CPU; ``select_by_lists``), with the same bits;
- decay ``p = p * keep``: the factor is ``keep`` or exactly 1 (``x * 1`` is ``x`` for
  every ``x``), in the dtype ``mul_`` by a number computes in: one 0-dim tensor for fp32
  and fp64 ``p`` (its own dtype: CUDA's one-kernel list form), expanded to ``p``'s shape
  for narrower ones, which every device then multiplies in fp32 (a 0-dim device tensor of
  another dtype would be rounded to ``p``'s dtype on CUDA);
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
# The integer dtype of each element width: a select's arithmetic on the bits (module docstring).
_BITS_AS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def select_by_lists(device: torch.device) -> bool:
    """Whether selects on ``device`` run as integer list ops where ``foreach`` allows (module
    docstring): everywhere but the CPU."""
    return device.type != "cpu"


def by_mask(oks: Tensors) -> list[tuple[torch.Tensor, list[int]]]:
    """The indices of ``oks`` grouped by mask (by identity: one step's masks are a few
    shared tensors), in first-seen order."""
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, ok in enumerate(oks):
        groups.setdefault(id(ok), (ok, []))[1].append(i)
    return list(groups.values())


def select_(targets: Tensors, oks: Tensors, news: Tensors | None = None, foreach: bool = False) -> None:
    """``targets[i] = news[i]`` where ``oks[i]`` holds, its own bits elsewhere; ``news``
    None: ``+0.0`` where ``oks[i]`` does not hold, its own bits where it does. With
    ``foreach``, list ops where they are multi-tensor kernels (:func:`select_by_lists`)."""
    for ok, idx in by_mask(oks):
        by_width: dict[tuple[torch.device, int], list[int]] = {}
        for i in idx:
            by_width.setdefault((targets[i].device, targets[i].element_size()), []).append(i)
        for (device, width), members in by_width.items():
            mine = [targets[i] for i in members]
            new = None if news is None else [news[i] for i in members]
            if foreach and select_by_lists(device) and width in _BITS_AS:
                _select_bits_(ok, mine, new, _BITS_AS[width])
            elif new is None:
                zero = torch.zeros((), dtype=mine[0].dtype, device=device)
                for target in mine:
                    torch.where(ok, target, zero, out=target)
            else:
                for target, value in zip(mine, new):
                    torch.where(ok, value, target, out=target)


def _select_bits_(ok: torch.Tensor, targets: Tensors, news: Tensors | None, dtype: torch.dtype) -> None:
    """:func:`select_` for tensors of one width on one device, as list ops on their bits
    seen as ``dtype`` integers: ``target * (1 - m) + new * m`` (``news`` None: ``target * m``)."""
    m = ok.to(dtype)
    bits = [t.view(dtype) for t in targets]
    if news is None:
        torch._foreach_mul_(bits, m)
        return
    new_bits = [n.view(dtype) for n in news]
    torch._foreach_mul_(new_bits, m)
    torch._foreach_mul_(bits, 1 - m)
    torch._foreach_add_(bits, new_bits)


def masked_momentum_(bufs: Tensors, grads: Tensors, momentum: float, oks: Tensors, foreach: bool = False) -> None:
    """``buf = lerp(buf, grad, 1 - momentum)`` where ``oks[i]``; ``buf`` keeps its bits
    elsewhere, whatever ``grad`` holds. With ``foreach``, the EMAs are computed by one list
    op per chunk of at most ``MASKED_CHUNK_NUMEL`` elements (or one tensor), and selected
    into their buffers after; else one buffer's copy at a time."""
    for chunk in _chunks(bufs, grads) if foreach else [[i] for i in range(len(bufs))]:
        news = (torch._foreach_lerp([bufs[i] for i in chunk], [grads[i] for i in chunk], 1 - momentum) if foreach
                else [bufs[chunk[0]].lerp(grads[chunk[0]], 1 - momentum)])
        select_([bufs[i] for i in chunk], [oks[i] for i in chunk], news, foreach)
        del news  # freed before the next chunk's are made: one chunk alive at a time


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


def mask_(tensors: Tensors, oks: Tensors, foreach: bool = False) -> None:
    """Set each tensor to ``+0.0`` where its ``ok`` is False (results before they travel
    back), whatever it holds (NaN included); unchanged where True (``foreach``: as in
    :func:`select_`)."""
    select_(tensors, oks, None, foreach)


def scalar_decay_factors(keep: float | torch.Tensor, oks: Tensors | None, like: Tensors,
                         scalars: StepScalars) -> list[torch.Tensor]:
    """Each tensor's decay factor, 0-dim (for :func:`cautious_decay_`'s ``keep``): ``keep``
    where its ``ok`` holds, exactly 1 elsewhere (``oks`` None: ``keep``, a device tensor),
    in the dtype ``mul_`` by a number computes in for that tensor; one per mask and dtype."""
    if oks is None:
        return [scalars.cast(keep, opmath_dtype(t.dtype)) for t in like]
    return [scalars.masked(keep, opmath_dtype(t.dtype), ok) for ok, t in zip(oks, like)]


def masked_decay_(params: Tensors, keep: float | torch.Tensor, oks: Tensors, foreach: bool,
                  scalars: StepScalars) -> None:
    """``p *= keep`` where its ``ok`` holds, ``p *= 1`` elsewhere: one factor, and with
    ``foreach`` one list op, per mask and dtype (``dmuon.numerics.device_scalars.decay_``)."""
    for ok, idx in by_mask(oks):
        decay_([params[i] for i in idx], keep, foreach, scalars, ok)


def masked_apply_(params: Tensors, orthos: Tensors, oks: Tensors, lr: float | torch.Tensor,
                  weight_decay: float | torch.Tensor, scale: float, cautious_weight_decay: bool, foreach: bool,
                  capturable: bool = False, scalars: StepScalars | None = None) -> None:
    """``dmuon.numerics.update_lists.apply_muon_updates_`` where ``ok``, nothing elsewhere:
    the decay's factor is masked here, and ``orthos`` must already be ``+0.0`` where not
    ``ok`` (:func:`mask_`), so the scaled step adds ``-0.0`` there. ``capturable``: ``lr``
    and ``weight_decay`` are device hyperparameters (:func:`device_apply_`). ``scalars``:
    the step's factors, made once a step."""
    if not params:
        return
    scalars = scalars or StepScalars()
    if capturable:
        device_apply_(params, orthos, oks, lr, weight_decay, scale, cautious_weight_decay, foreach, scalars)
        return
    if isinstance(lr, torch.Tensor):
        lr = lr.squeeze()
    keep = 1 - lr * weight_decay
    if cautious_weight_decay:
        for param, ortho, factor in zip(params, orthos, scalar_decay_factors(keep, oks, params, scalars)):
            cautious_decay_(param, ortho, lr, weight_decay, keep=factor)
    elif weight_decay != 0:
        masked_decay_(params, keep, oks, foreach, scalars)
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
    else:
        masked_decay_(params, keep, oks, foreach, scalars)
    scaled_add_(params, orthos, scalars.alpha(lr, scale), foreach, scalars)


class UnitMasks:
    """One step's parameter masks read per unit (``param_of_unit``: each unit's parameter)."""

    def __init__(self, ok: Sequence[torch.Tensor], param_of_unit: Sequence[int], foreach: bool) -> None:
        self.ok, self.param_of_unit, self.foreach = ok, param_of_unit, foreach

    def zero_masked(self, units: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """Set the results of ``units`` to ``+0.0`` where their parameter's mask is False, in
        place (on the owner, before they travel back)."""
        mask_(results, [self.ok[self.param_of_unit[i]] for i in units], self.foreach)
