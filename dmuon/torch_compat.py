"""Every private PyTorch API dmuon uses, in one place, with the torch versions it was
checked on.

torch promises nothing for names that start with an underscore, so none is imported
anywhere else in dmuon (``tests/test_package_boundaries.py`` checks it). When a new torch
moves one, this module is the one to change, and its tests say which entry broke.

| name | what dmuon uses it for | checked on |
| --- | --- | --- |
| ``compute_local_shape_and_global_offset`` | DTensor's own answer for a rank's block, to check the plan's layout at the first step | 2.13.0, 2.15.0 |
| ``StridedShard`` (``_StridedShard``) | FSDP2 over a TP-sharded weight: a placement the layout rules must read | 2.13.0, 2.15.0 |
| ``scalar_dtype`` (``torch.optim.optimizer._get_scalar_dtype``) | the dtype of AdamW's ``step`` state, as torch.optim.AdamW makes it | 2.13.0, 2.15.0 |
| ``mkldnn_bf16_supported`` (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) | whether a CPU has a native bf16 GEMM (``ns_dtype="auto"``) | 2.13.0, 2.15.0 |
"""

from __future__ import annotations

import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.optim.optimizer import _get_scalar_dtype as scalar_dtype

# The lowest torch dmuon supports (pyproject.toml's requirement) and the newest it was tested on.
OLDEST_TESTED_TORCH = "2.13.0"
NEWEST_TESTED_TORCH = "2.15.0"

__all__ = ["StridedShard", "compute_local_shape_and_global_offset", "mkldnn_bf16_supported", "scalar_dtype"]


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN has a bf16 GEMM for this CPU (AVX-512, AMX, Arm BF16)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
