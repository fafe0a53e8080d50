"""One tensor's call of Muon's list rules (``dmuon.numerics.update_rules``), and Newton-Schulz with
its settings as keywords: the forms the unit tests check against hand formulas. The step itself
calls the list rules with a group's settings (``dmuon.step.group_steps``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.numerics.newton_schulz import DEFAULT_GRAM_RESTARTS, DEFAULT_NS_ALGORITHM, Triple
from dmuon.numerics.update_rules import apply_muon_, compute_copy, lookahead, momentum_, orthogonalize_update


def nesterov_lookahead(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """What Muon orthogonalizes, once ``buf`` holds this step's momentum: ``lerp(grad, buf,
    momentum)`` with Nesterov, else ``buf``."""
    return grad.lerp(buf, momentum) if nesterov else buf


def muon_momentum_(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the momentum buffer in place; return the bf16 copy of the look-ahead to orthogonalize."""
    momentum_([buf], [grad], momentum, foreach=False)
    return compute_copy(lookahead([grad], [buf], momentum, nesterov, False)[0])


def apply_muon_update_(param: torch.Tensor, ortho: torch.Tensor, lr: float | torch.Tensor, weight_decay: float,
                       scale: float, cautious_weight_decay: bool = False) -> None:
    """Decoupled weight decay with the unscaled ``lr``, then the scaled orthogonal step."""
    apply_muon_([param], [ortho], lr=lr, weight_decay=weight_decay, scale=scale,
                cautious_weight_decay=cautious_weight_decay)


def newton_schulz(update: torch.Tensor, *, ns_coefficients: str | Triple | Sequence[Triple], ns_steps: int,
                  eps: float, ns_dtype: torch.dtype, split_rows: int | None, ns_algorithm: str = DEFAULT_NS_ALGORITHM,
                  ns_gram_restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> torch.Tensor:
    """``orthogonalize_update`` with its group settings as keywords (no NorMuon)."""
    group = dict(ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps, split_rows=split_rows,
                 ns_gram_restarts=ns_gram_restarts, normuon=False)
    return orthogonalize_update(update, group, ns_dtype, ns_algorithm)
