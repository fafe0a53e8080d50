"""What ``DMuon.load_state_dict`` changes in torch's: Muon's state and the AdamW part's kept
moments keep their saved dtypes, and a capturable group's state its tensors.

torch casts every state value but ``step`` to its parameter's dtype on load (right for
AdamW's moments as torch makes them; int8 values included, which would keep the int8 key
with float values). DMuon's state may be made in another:
NorMuon's second moment is fp32 beside bf16 parameters, and a checkpoint's momentum may
be kept wider than the parameter. Cast to the parameter's dtype, a bf16 resume would no
longer match the uninterrupted run. So after torch's load, those values are taken again
from the state dict as saved, moved to the parameter's device only.

torch's load also puts new tensor objects into the state (the checkpoint's, or copies of
them). A step captured in a CUDA graph reads the old ones: for a capturable group the
loaded values are copied into the tensors the state held before (:func:`keep_state_tensors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def keep_saved_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], keys: Sequence[str]) -> None:
    """Replace ``keys`` of the loaded state by the saved values on the parameter's device,
    matching saved and current parameters as torch does (in group order)."""
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for saved_id, param in zip(saved_ids, params):
        saved = state_dict["state"].get(saved_id)
        if not saved or param not in optimizer.state:
            continue
        for key in keys:
            value = saved.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != optimizer.state[param][key].dtype:
                optimizer.state[param][key] = value.to(device=param.device, copy=True)


def state_tensors(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """Each parameter's state tensors of a ``capturable`` group, by key (what a captured
    step reads: :func:`keep_state_tensors` puts a load's values back into them)."""
    return {param: {key: value for key, value in optimizer.state[param].items() if isinstance(value, torch.Tensor)}
            for group in optimizer.param_groups if group.get("capturable")
            for param in group["params"] if param in optimizer.state}


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return not isinstance(a, DTensor) or (a.placements == b.placements and a.device_mesh == b.device_mesh)


def keep_state_tensors(optimizer: torch.optim.Optimizer, before: dict[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    """After a load: each loaded state value copied into the tensor ``before`` held for its key
    (:func:`state_tensors`), which goes back into the state, where both have one layout (shape,
    dtype, device, placements). A CUDA graph captured before the load
    (``dmuon.capture.cuda_graphs``) then reads the loaded values; a value of another layout
    stays as loaded, and the graph's replay guard refuses to replay over it."""
    for param, held in before.items():
        loaded = optimizer.state.get(param, {})
        for key, old in held.items():
            new = loaded.get(key)
            if isinstance(new, torch.Tensor) and new is not old and _same_layout(old, new):
                old.copy_(new)
                loaded[key] = old
