"""The Muon and AdamW update rules, as pure elementwise functions on tensors.

Muon, for a matrix W (A x B) with gradient G (torch.optim.Muon semantics)::

    buf = lerp(buf, G, 1 - momentum)                   # EMA momentum
    U   = lerp(G, buf, momentum) if nesterov else buf  # Nesterov look-ahead
    O   = orthogonalize(U)                             # newton_schulz.py, bf16 in and out
    W   = W * (1 - lr * weight_decay)                  # decoupled decay, unscaled lr
    W   = W - lr * shape_scale(A, B) * O

Every line except ``orthogonalize`` is elementwise, so it gives the same bits on a
row shard as on the whole matrix. That is what lets the distributed step keep momentum
and the final update on the local shards and move only ``U`` and ``O``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.optim.adamw import adamw as _torch_adamw

from dmuon.newton_schulz import UPDATE_DTYPE, matrix_shape

# Shape-aware learning-rate scales (``DMuon(adjust_lr=...)``).
ADJUST_LR_CHOICES = ("original", "match_rms_adamw", "spectral", None)
# Moonlight's choice: Muon's update RMS matched to a typical AdamW update RMS of 0.2.
DEFAULT_MATCHED_ADAMW_RMS = 0.2


def shape_scale(shape: Sequence[int], adjust_lr: str | None, matched_adamw_rms: float) -> float:
    """Factor applied to ``lr`` for the orthogonalized update of a parameter of ``shape``.

    With ``A x B`` the matrix Newton-Schulz sees (for ``[E, A, B]`` experts, one expert):

    - ``"original"`` (Keller Jordan, torch.optim.Muon's default): ``sqrt(max(1, A / B))``
    - ``"match_rms_adamw"`` (Moonlight): ``matched_adamw_rms * sqrt(max(A, B))``
    - ``"spectral"`` (Dion's default): ``sqrt(A / B)``
    - ``None``: 1, no adjustment.
    """
    rows, cols = matrix_shape(shape)[-2:]
    if adjust_lr == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return matched_adamw_rms * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":
        return math.sqrt(rows / cols)
    if adjust_lr is None:
        return 1.0
    raise ValueError(f"unknown adjust_lr {adjust_lr!r}; expected one of {ADJUST_LR_CHOICES}")


def muon_momentum_(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the momentum buffer in place; return the tensor to orthogonalize.

    The result is cast to bf16 with a copy: it never aliases ``buf``, whatever the
    buffer's dtype, so orthogonalizing it cannot corrupt momentum.
    """
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    return update.to(UPDATE_DTYPE, copy=True)


def apply_muon_update_(
    param: torch.Tensor, ortho: torch.Tensor, lr: float | torch.Tensor, weight_decay: float, scale: float
) -> None:
    """Decoupled weight decay with the unscaled ``lr``, then the scaled orthogonal step.

    A Tensor ``lr`` (one element, any shape) is used as torch.optim.Muon uses it: as a
    0-dim tensor (``alpha`` takes no other), with the same tensor arithmetic, so the bits
    are torch's for that Tensor.
    """
    if isinstance(lr, torch.Tensor):
        lr = lr.squeeze()
    param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-lr * scale)


def adamw_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step, delegated to torch's functional AdamW so the bits match
    ``torch.optim.AdamW`` with the same hyperparameters, a one-element Tensor ``lr``
    included (it also handles DTensors and complex tensors)."""
    _torch_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=None,
        has_complex=any(p.is_complex() for p in params),
        amsgrad=False,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
