"""The reference way: every rank gathers the whole bf16 update, orthogonalizes it, and
keeps its own part. Simple and layout-agnostic, but every rank runs Newton-Schulz on
every matrix and receives all of it: the baseline the owner exchange is measured by."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def orthogonalize_gathered(update: torch.Tensor, param: DTensor,
                           orthogonalize_whole: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """All-gather ``update`` (this rank's part of ``param``'s update), orthogonalize the
    whole, and return this rank's part of the result (a collective on ``param``'s mesh)."""
    mesh, placements = param.device_mesh, param.placements
    full = DTensor.from_local(update, mesh, placements, shape=param.shape, stride=param.stride()).full_tensor()
    return distribute_tensor(orthogonalize_whole(full), mesh, placements, src_data_rank=None).to_local()
