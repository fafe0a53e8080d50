"""The step's device masks, applied: each parameter has a 0-dim bool ``ok`` on the device, and a
masked rule (``dmuon.numerics.update_rules``: ``oks=``) gives the unmasked rule's bits where it is
True and leaves the tensor's bits where it is False (``-0.0``, inf and a state's NaN included):
whether a rank may apply is known only on the device, after the ranks' status is summed
(``dmuon.exchange.grad_status``). A step has few distinct masks (``dmuon.exchange.status_masks``),
so each rule runs one list op per mask (:func:`by_mask`). :func:`select_` is exact on the bits seen
as integers (``target * (1 - m) + new * m``: three list ops where a list op is one kernel, else one
``torch.where`` per tensor); :func:`mask_` zeroes results (a NaN dropped, not multiplied by 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensors = Sequence[torch.Tensor]
# The integer dtype of each element width: a select's arithmetic on the bits (module docstring).
_BITS_AS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def select_by_lists(device: torch.device) -> bool:
    """Whether selects on ``device`` run as integer list ops where ``foreach`` allows:
    not on the CPU."""
    return device.type != "cpu"


def by_mask(oks: Tensors) -> list[tuple[torch.Tensor, list[int]]]:
    """The indices of ``oks`` grouped by mask (by identity: a step's few shared masks), in
    first-seen order."""
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, ok in enumerate(oks):
        groups.setdefault(id(ok), (ok, []))[1].append(i)
    return list(groups.values())


def select_(targets: Tensors, oks: Tensors, news: Tensors | None = None, foreach: bool = False) -> None:
    """``targets[i] = news[i]`` where ``oks[i]`` holds, its own bits elsewhere (``news`` None:
    ``+0.0`` where it does not hold). With ``foreach``, list ops where :func:`select_by_lists`."""
    for ok, idx in by_mask(oks):
        by_width: dict[tuple[torch.device, int], list[int]] = {}
        for i in idx:
            by_width.setdefault((targets[i].device, targets[i].element_size()), []).append(i)
        for (device, width), members in by_width.items():
            mine = [targets[i] for i in members]
            new = None if news is None else [news[i] for i in members]
            if foreach and select_by_lists(device) and width in _BITS_AS:  # on the bits: target * (1 - m) + new * m
                m = ok.to(_BITS_AS[width])
                bits = [t.view(_BITS_AS[width]) for t in mine]
                if new is None:
                    torch._foreach_mul_(bits, m)
                    continue
                new_bits = [n.view(_BITS_AS[width]) for n in new]
                torch._foreach_mul_(new_bits, m)
                torch._foreach_mul_(bits, 1 - m)
                torch._foreach_add_(bits, new_bits)
            elif new is None:
                zero = torch.zeros((), dtype=mine[0].dtype, device=device)
                for target in mine:
                    torch.where(ok, target, zero, out=target)
            else:
                for target, value in zip(mine, new):
                    torch.where(ok, value, target, out=target)


def mask_(tensors: Tensors, oks: Tensors, foreach: bool = False) -> None:
    """Set each tensor to ``+0.0`` where its ``ok`` is False, whatever it holds (NaN included);
    unchanged where True (results on the owner, before they travel back)."""
    select_(tensors, oks, None, foreach)
