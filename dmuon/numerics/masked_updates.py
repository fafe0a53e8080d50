"""The elementwise rules of ``dmuon.numerics.update_lists`` under a device mask: each
parameter ``j`` has a 0-dim bool ``ok[j]`` on the device; where it is True the rule
gives exactly the bits of the unmasked rule, where it is False the tensor keeps its bits.

Why a mask and not a host branch: the distributed step runs the same ops on every rank
whatever its grads (``dmuon.exchange.grad_status``), and whether a rank may apply a
parameter's update is known only on the device, after the ranks' status is summed. So the
mask is read by the kernels and never by the host.

How each rule stays exact:

- momentum ``buf = lerp(buf, grad, w)``: a weight of 0 leaves ``buf``; for fp32 and fp64
  buffers the weight is a 0-dim tensor of the buffer's dtype (``lerp_`` by a tensor
  weight of its own dtype computes what ``lerp_`` by the number computes); a narrower
  buffer would round a tensor weight to its dtype, so there the grad is replaced by the
  buffer itself where masked (``lerp(buf, buf, w)`` is ``buf``) and the number is kept;
- decay ``p = p * keep``: the factor is ``keep`` or 1 in the dtype ``mul_`` by a number
  computes in: a 0-dim tensor for fp32 and fp64 ``p`` (its own dtype), expanded to ``p``'s
  shape for narrower ones, which every device then multiplies in fp32 (a 0-dim device
  tensor of another dtype would be rounded to ``p``'s dtype on CUDA);
- the step ``p = p - lr * scale * O``: ``O`` is zeroed where masked (:func:`mask_`, on the
  owner, before it travels), and ``p - lr * scale * 0`` is ``p``.

A non-finite value is not masked away (``0 * NaN`` is NaN): a NaN grad makes its matrix
non-finite on every rank, as documented for the unmasked step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.numerics.update_lists import by_signature
from dmuon.numerics.update_rules import cautious_decay_

Tensors = Sequence[torch.Tensor]
# Buffer dtypes whose lerp_ by a 0-dim tensor weight of their own dtype is exactly lerp_ by the number.
EXACT_TENSOR_WEIGHT_DTYPES = (torch.float32, torch.float64)


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an elementwise op by a Python number computes in for ``dtype`` tensors."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def where_ok(ok: torch.Tensor, value: float | torch.Tensor, otherwise: float, dtype: torch.dtype) -> torch.Tensor:
    """``value`` where ``ok`` else ``otherwise``, elementwise over the bool vector ``ok``,
    in ``dtype``, filled on ``ok``'s device (no copy from the host)."""
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=dtype, device=ok.device)
    return torch.where(ok, value.to(device=ok.device, dtype=dtype),
                       torch.full((), otherwise, dtype=dtype, device=ok.device))


def masked_momentum_(bufs: Tensors, grads: Tensors, momentum: float, oks: Tensors) -> None:
    """``buf = lerp(buf, grad, 1 - momentum)`` where ``oks[i]``; ``buf`` unchanged elsewhere."""
    if not bufs:
        return
    ok = torch.stack(list(oks))
    for idx in by_signature(bufs, grads):
        dtype = bufs[idx[0]].dtype
        if dtype in EXACT_TENSOR_WEIGHT_DTYPES:
            weights = where_ok(ok, 1 - momentum, 0.0, dtype).unbind()
            torch._foreach_lerp_([bufs[i] for i in idx], [grads[i] for i in idx], [weights[i] for i in idx])
            continue
        for i in idx:
            bufs[i].lerp_(torch.where(oks[i], grads[i], bufs[i]), 1 - momentum)


def mask_(tensors: Tensors, oks: Tensors) -> None:
    """Zero each tensor where its ``ok`` is False (results before they travel back); an
    ``ok`` already in the tensor's dtype costs no cast."""
    if tensors:
        torch._foreach_mul_(list(tensors), [ok if ok.dtype == t.dtype else ok.to(t.dtype) for ok, t in zip(oks, tensors)])


def decay_factors(keep: float | torch.Tensor, oks: Tensors, like: Tensors) -> list[torch.Tensor]:
    """Each tensor's decay factor: ``keep`` where ``ok`` else 1, in the dtype ``mul_`` by
    a number computes in for that tensor, expanded to its shape (see the module docstring)."""
    # A 0-dim factor of the tensor's own dtype is read exactly (fp32, fp64): no view needed.
    return [factor if factor.dtype == t.dtype else factor.expand(t.shape)
            for factor, t in zip(scalar_decay_factors(keep, oks, like), like)]


def scalar_decay_factors(keep: float | torch.Tensor, oks: Tensors, like: Tensors) -> list[torch.Tensor]:
    """:func:`decay_factors` as 0-dim tensors (for :func:`cautious_decay_`'s ``keep``)."""
    if not like:
        return []
    ok = torch.stack(list(oks))
    by_dtype = {dtype: where_ok(ok, keep, 1.0, dtype).unbind() for dtype in {opmath_dtype(t.dtype) for t in like}}
    return [by_dtype[opmath_dtype(t.dtype)][i] for i, t in enumerate(like)]


def masked_apply_(params: Tensors, orthos: Tensors, oks: Tensors, lr: float | torch.Tensor, weight_decay: float,
                  scale: float, cautious_weight_decay: bool, foreach: bool) -> None:
    """``dmuon.numerics.update_lists.apply_muon_updates_`` where ``ok``, nothing elsewhere:
    the decay's factor is masked here, and ``orthos`` must already be zero where not ``ok``
    (:func:`mask_`), so the scaled step adds zeros there."""
    if not params:
        return
    if isinstance(lr, torch.Tensor):
        lr = lr.squeeze()
    keep = 1 - lr * weight_decay
    if cautious_weight_decay:
        for param, ortho, factor in zip(params, orthos, scalar_decay_factors(keep, oks, params)):
            cautious_decay_(param, ortho, lr, weight_decay, keep=factor)
    elif weight_decay != 0:
        torch._foreach_mul_(list(params), decay_factors(keep, oks, params))
    if foreach and not isinstance(lr, torch.Tensor):
        for idx in by_signature(params, orthos):
            torch._foreach_add_([params[i] for i in idx], [orthos[i] for i in idx], alpha=-lr * scale)
        return
    for param, ortho in zip(params, orthos):
        param.add_(ortho, alpha=-lr * scale)


class MasksByDtype:
    """One step's parameter masks cast to a results' dtype once (one op), read per unit
    (``param_of_unit``: each unit's parameter)."""

    def __init__(self, ok: Sequence[torch.Tensor], param_of_unit: Sequence[int]) -> None:
        self.ok, self.param_of_unit = ok, param_of_unit
        self.cast: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}

    def zero_masked(self, units: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """Zero the results of ``units`` where their parameter's mask is False, in place: one
        list op (on the owner, before they travel back)."""
        if results:
            mask_(results, self.of(units, results[0].dtype))

    def of(self, units: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
        if dtype not in self.cast:
            self.cast[dtype] = torch.stack(list(self.ok)).to(dtype).unbind()
        return [self.cast[dtype][self.param_of_unit[i]] for i in units]
