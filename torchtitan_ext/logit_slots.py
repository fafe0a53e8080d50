"""Each attention's slot for its logit maxima, for the QK-clip hooks of both TorchTitan
lines (``titan02/max_logits.py``, ``titan03/max_logits.py``).

TorchTitan compiles each transformer block with ``fullgraph=True``, so a hook on the
block's attention is traced into the block's graph. The hook therefore folds into a tensor
of its own, made here once per attention before any forward (``MaxLogitTracker.slot``),
rather than into DMuon's name-keyed maxima: every block then traces the same ops and one
compiled graph serves them all (``dmuon/attention/max_logits.py`` says why). Imports
nothing from TorchTitan.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from dmuon import DMuon, mesh_device


def logit_slot(optimizer: DMuon, name: str, n_heads: int, q_weight: torch.Tensor) -> torch.Tensor:
    """Attention ``name``'s slot in ``optimizer``'s tracker, on the device its ``q`` is
    computed on: the weight's mesh device (also under FSDP2's CPU offload, whose shards sit
    on the host), or a plain weight's own."""
    device = mesh_device(q_weight.device_mesh) if isinstance(q_weight, DTensor) else q_weight.device
    return optimizer.max_logits.slot(name, n_heads, device)
