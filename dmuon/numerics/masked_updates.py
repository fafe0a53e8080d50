"""The step's device masks, applied: each parameter ``j`` has a 0-dim bool ``ok[j]`` on the
device, and a masked rule (``dmuon.numerics.update_lists``: ``oks=``) gives exactly the
unmasked rule's bits where it is True and leaves the tensor's bits where it is False,
``-0.0`` and inf included; a state tensor's NaN keeps its bits too, a parameter's NaN stays
NaN (the decay's product by exactly 1 may quiet its payload, e.g. on bf16 CPU tensors).

Why a mask and not a host branch: the distributed step runs the same ops on every rank
whatever its grads (``dmuon.exchange.grad_status``), and whether a rank may apply a
parameter's update is known only on the device, after the ranks' status is summed. So the
mask is read by the kernels and never by the host.

A step has few distinct masks (``dmuon.exchange.status_masks``: the step's own, shared by
every parameter with a grad, and a False one for those without), so every rule runs one
list op per distinct mask (by identity, :func:`by_mask`), not one op per tensor.

Here, the two primitives the rules and the exchange use:

- :func:`select_`: ``target = new`` where ``ok``, its own bits elsewhere; exact arithmetic on
  the tensors' bits seen as integers of their width, ``target * (1 - m) + new * m`` with
  ``m`` 0 or 1 (each product is the value or 0, so the sum never overflows): with
  ``foreach``, three list ops per mask and width on CUDA, where a list op is one
  multi-tensor kernel; on the CPU, where a list op loops over its tensors, and without
  ``foreach``, one ``torch.where`` per tensor (cheaper on the CPU; :func:`select_by_lists`),
  with the same bits;
- :func:`mask_`: results set to ``+0.0`` where masked (a NaN result of a masked matrix is
  dropped, not multiplied by 0), on the owner before they travel back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


Tensors = Sequence[torch.Tensor]
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


def mask_(tensors: Tensors, oks: Tensors, foreach: bool = False) -> None:
    """Set each tensor to ``+0.0`` where its ``ok`` is False (results before they travel
    back), whatever it holds (NaN included); unchanged where True (``foreach``: as in
    :func:`select_`)."""
    select_(tensors, oks, None, foreach)


class UnitMasks:
    """One step's parameter masks read per unit (``param_of_unit``: each unit's parameter)."""

    def __init__(self, ok: Sequence[torch.Tensor], param_of_unit: Sequence[int], foreach: bool) -> None:
        self.ok, self.param_of_unit, self.foreach = ok, param_of_unit, foreach

    def zero_masked(self, units: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """Set the results of ``units`` to ``+0.0`` where their parameter's mask is False, in
        place (on the owner, before they travel back)."""
        mask_(results, [self.ok[self.param_of_unit[i]] for i in units], self.foreach)
