"""The local way: the rank already holds the whole parameter, so nothing moves."""

from __future__ import annotations

from collections.abc import Callable

import torch


def orthogonalize_local(update: torch.Tensor, param: torch.Tensor,
                        orthogonalize_whole: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Newton-Schulz of the rank's own update (a plain tensor, or a DTensor's local
    tensor when that is the whole parameter)."""
    return orthogonalize_whole(update)
