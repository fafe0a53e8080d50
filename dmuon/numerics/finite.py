"""Whether a set of tensors is finite, decided on the device (``skip_nonfinite``).

The infinity norm of each tensor (``torch._foreach_norm``, one list op per device and dtype) is
the largest magnitude it holds: a NaN propagates into it, an inf is it, and a finite tensor's
is finite (a maximum of representable values never overflows, unlike a sum of squares). No host
read: the answer stays a 0-dim bool on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.numerics.update_rules import by_signature


def all_finite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """True (a 0-dim bool on ``device``) when no element of ``tensors`` is NaN or inf. Tensors on
    another device (FSDP2's CPU offload) are checked where they are and their answer copied over."""
    ok = torch.ones((), dtype=torch.bool, device=device)
    nonempty = [t for t in tensors if t.numel()]  # no infinity norm of nothing
    for idx in by_signature(nonempty):
        norms = torch._foreach_norm([nonempty[i] for i in idx], ord=float("inf"))
        ok = ok & _on(torch.stack(norms).isfinite().all(), device)
    return ok


def _on(answer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``answer`` on ``device``; from the host through pinned memory, without a wait (a copy
    from pageable memory would make the host wait for the device)."""
    if answer.device == device:
        return answer
    if answer.device.type == "cpu":
        pinned = torch.empty((), dtype=answer.dtype, pin_memory=True)
        answer = pinned.copy_(answer)
    return answer.to(device, non_blocking=True)
