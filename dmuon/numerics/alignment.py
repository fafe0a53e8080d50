"""Matrices read by reductions start where a single process's would: aligned.

The owner's matrices are views of one buffer, at whatever offsets the plan packs them. CUDA's
vectorized reductions (``ATen/native/cuda/Reduce.cuh``) split their work by the start's
alignment, so the norm of a view at an odd offset may be summed in another order than the norm
of the fresh, aligned tensor a single process holds: a bit of the signature promise.
:func:`aligned` copies such a view once on an accelerator; a storage itself starts aligned, so
the offset (a host fact) is all it reads. The CPU's reductions walk a tensor from its first
element whatever its address, so there it copies nothing."""

from __future__ import annotations

import torch

# The alignment, in bytes, of the widest vector load CUDA's reductions make.
REDUCTION_ALIGNMENT_BYTES = 16


def aligned(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix``, or a fresh copy of it when it starts off the reductions' alignment on
    an accelerator."""
    if matrix.device.type != "cpu" and matrix.storage_offset() * matrix.element_size() % REDUCTION_ALIGNMENT_BYTES:
        return matrix.clone()
    return matrix
