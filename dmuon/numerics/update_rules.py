"""The Muon update rules, as pure elementwise functions on tensors (AdamW's: ``dmuon.numerics.adamw_rules``).

Muon, for a matrix W (A x B) with gradient G (torch.optim.Muon semantics)::

    buf = lerp(buf, G, 1 - momentum)                   # EMA momentum
    U   = lerp(G, buf, momentum) if nesterov else buf  # Nesterov look-ahead
    O   = orthogonalize(U)                             # newton_schulz.py, bf16 in and out
    W   = W * (1 - lr * weight_decay)                  # decoupled decay, unscaled lr
    W   = W - lr * shape_scale(A, B) * O

Every line except ``orthogonalize`` is elementwise, so it gives the same bits on a
row shard as on the whole matrix. That is what lets the distributed step keep momentum
and the final update on the local shards and move only ``U`` and ``O``.

Two variants, each a group option, off by default:

- NorMuon (Li et al., arXiv 2510.05491; :func:`normuon_normalize_`): after
  ``orthogonalize``, each row of ``O`` is divided by the root of an EMA of its mean
  square, and the matrix is rescaled to ``O``'s Frobenius norm. It reads whole rows
  and the whole matrix, so it runs where ``O`` is whole (the owner), before ``O``
  travels back; the result is rounded to bf16 like ``O`` itself.
- Cautious weight decay (Chen et al., arXiv 2510.12402; :func:`cautious_decay_`):
  the decay applies only where ``update * W >= 0``. Elementwise, so it runs on the
  local shards like the plain decay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dmuon.numerics.newton_schulz import UPDATE_DTYPE, matrix_shape

# Shape-aware learning-rate scales (``DMuon(adjust_lr=...)``).
ADJUST_LR_CHOICES = ("original", "match_rms_adamw", "spectral", None)
# Moonlight's choice: Muon's update RMS matched to a typical AdamW update RMS of 0.2.
DEFAULT_MATCHED_ADAMW_RMS = 0.2
# NorMuon's EMA coefficient of the per-row second moment, and the guard added to its
# root and to the rescaled norm: the values of the official implementation
# (github.com/zichongli5/NorMuon, normuon.py: beta2=0.95, 1e-10).
DEFAULT_NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-10


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


def nesterov_lookahead(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """What Muon orthogonalizes, in the parameter's dtype, once ``buf`` holds this step's
    momentum: ``lerp(grad, buf, momentum)`` (a new tensor) with Nesterov, else ``buf``."""
    return grad.lerp(buf, momentum) if nesterov else buf


def compute_copy(lookahead: torch.Tensor) -> torch.Tensor:
    """What Newton-Schulz orthogonalizes, from the look-ahead: a bf16 copy, so that it never
    aliases the momentum (without Nesterov the look-ahead is the buffer itself) and
    orthogonalizing it in place cannot touch the momentum. The one place it is made."""
    return lookahead.to(UPDATE_DTYPE, copy=True)


def lookahead_copy(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """The look-ahead, then its compute copy: one tensor's input to Newton-Schulz."""
    return compute_copy(nesterov_lookahead(grad, buf, momentum, nesterov))


def normuon_second_moment_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of NorMuon's state for a parameter of ``shape``: one value per row of
    the matrices Newton-Schulz sees (``[A, 1]``; ``[E, A, 1]`` for experts; ``[O, 1]``
    for a 4-D+ weight seen as ``[O, rest]``)."""
    return (*matrix_shape(shape)[:-1], 1)


def normuon_normalize_(
    ortho: torch.Tensor, second_moment: torch.Tensor, beta2: float, split_rows: int | None = None,
    ok: torch.Tensor | None = None,
) -> torch.Tensor:
    """NorMuon's neuron-wise normalization of an orthogonalized update; updates
    ``second_moment`` in place and returns a new bf16 tensor of ``ortho``'s shape.

    Per matrix ``O`` (each expert of a stack, each block of ``split_rows`` rows), in
    fp32, as the official implementation (github.com/zichongli5/NorMuon)::

        v = lerp(v, mean(O * O, dim=-1), 1 - beta2)    # per-row EMA, no bias correction
        N = O * (1 / (sqrt(v) + 1e-10))
        N = N * (||O||_F / (||N||_F + 1e-10))          # keep O's Frobenius norm

    ``second_moment`` holds ``v`` for every row of ``ortho`` (``[..., rows, 1]``, any
    float dtype). Each matrix is computed alone, with the same ops on the same shape,
    so an owner holding one unit gets the bits a single process gets for the stack.

    ``ok`` (a 0-dim bool on the device): where False, ``second_moment`` keeps its bits
    (the EMA is computed out of place and selected with ``torch.where``, so a NaN row of a
    masked matrix does not reach it).
    """
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


def cautious_mask(update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Where cautious weight decay applies: ``update * param >= 0`` elementwise (the
    paper's ``I(u_t x_t >= 0)``: a zero on either side counts as agreeing). Read from
    the signs, so a product too small for the dtype cannot flip it; NaN gives False."""
    return torch.sign(update) * torch.sign(param) >= 0


def cautious_decay_(param: torch.Tensor, update: torch.Tensor, factor: torch.Tensor) -> None:
    """Decoupled weight decay only where ``update`` and ``param`` agree in sign
    (Chen et al., arXiv 2510.12402, Algorithm 1: ``x -= lr * wd * I(u x >= 0) * x``).

    Where the mask holds, ``param`` is multiplied by ``factor``, the plain decay's factor
    ``1 - lr * weight_decay`` (0-dim, in the dtype ``mul_`` by a number computes in: made by
    ``dmuon.numerics.update_lists.decay_factor``, e.g. exactly 1 where a step is masked), so
    with every sign agreeing the bits are the plain decay's; elsewhere it is left as it is.
    """
    one = torch.ones((), dtype=factor.dtype, device=param.device)
    param.mul_(torch.where(cautious_mask(update, param), factor, one))
