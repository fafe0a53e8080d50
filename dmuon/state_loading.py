"""What ``DMuon.load_state_dict`` changes in torch's: Muon's state keeps its saved dtype.

torch casts every floating state value to its parameter's dtype on load (right for
AdamW's moments, which torch makes in that dtype). Muon's state may be made in another:
NorMuon's second moment is fp32 beside bf16 parameters, and a checkpoint's momentum may
be kept wider than the parameter. Cast to the parameter's dtype, a bf16 resume would no
longer match the uninterrupted run. So after torch's load, those values are taken again
from the state dict as saved, moved to the parameter's device only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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
