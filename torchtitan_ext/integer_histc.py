"""``torch.histc`` for integer CPU tensors, counting exactly as the CUDA kernel does.

TorchTitan's MoE router counts the tokens routed to each expert with
``torch.histc(expert_indices, bins=E, min=0, max=E)`` on an int64 tensor. CUDA
implements ``histc`` for integer dtypes; the CPU kernel does not
(``"histogram_cpu" not implemented for 'Long'``). ``integer_histc`` reproduces
the CUDA kernel (``aten/src/ATen/native/cuda/SummaryOps.cu``,
``_histc_cuda_template`` and ``getBin``) in integer arithmetic:

* the result has ``bins`` entries and the input's dtype;
* ``min == max`` means "use the data's min and max"; if those are equal too
  (or the input is empty) the range becomes ``[min - 1, max + 1]``;
* only values with ``min <= v <= max`` are counted, in bin
  ``(v - min) * bins // (max - min)`` (int64 arithmetic, as on CUDA), the value
  ``max`` itself in the last bin.

For the router's call (indices in ``[0, E)``, ``bins = E``, range ``[0, E]``)
this is ``bincount(indices, minlength=E)``, but the general form keeps any other
caller's counts identical to what a GPU would give.
"""

from __future__ import annotations

import torch

# The integer dtypes CUDA's histc dispatches on (AT_DISPATCH_ALL_TYPES minus floats).
HISTC_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def integer_histc(input: torch.Tensor, bins: int = 100, min: int | float = 0, max: int | float = 0) -> torch.Tensor:
    """Histogram of an integer tensor, with CUDA ``torch.histc`` semantics (see module doc)."""
    if input.dtype not in HISTC_INTEGER_DTYPES:
        raise TypeError(f"integer_histc expects an integer tensor, got {input.dtype}")
    if bins <= 0:
        raise RuntimeError("bins must be > 0")
    # CUDA converts the Scalar bounds to int64 (Scalar.to<int64_t>: truncation toward zero).
    lo, hi = int(min), int(max)
    values = input.reshape(-1).to(torch.int64)
    if lo == hi and values.numel() > 0:
        lo, hi = int(values.min()), int(values.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if not lo < hi:
        raise RuntimeError("max must be larger than min")
    values = values[(values >= lo) & (values <= hi)]
    bin_of = torch.div((values - lo) * bins, hi - lo, rounding_mode="floor")
    bin_of = bin_of.clamp_(max=bins - 1)  # only v == max lands on `bins`: last bin, inclusive
    return torch.bincount(bin_of, minlength=bins).to(input.dtype)
