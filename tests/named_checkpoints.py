"""DCP checkpoints of named parameters and their optimizer, written and read on real ranks, for
the multi-rank scenarios that save on one world size (or mesh) and resume on another: the
parameters as one module (``nn.ParameterDict``, dots in names made underscores), saved and
loaded through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` as
TorchTitan does. (TorchTitan's own checkpoints, read offline: ``tests/checkpoints.py``.)"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim import Optimizer


def as_module(params: dict[str, nn.Parameter]) -> nn.Module:
    """``params`` as one module whose state dict DCP saves."""
    return nn.ParameterDict({n.replace(".", "_"): p for n, p in params.items()})


def save_named(checkpoint_dir: str, params: dict[str, nn.Parameter], optimizer: Optimizer) -> None:
    """A DCP checkpoint of the weights and the optimizer (every state key, int8 values and scales included)."""
    module = as_module(params)
    dcp.save({"model": module.state_dict(), "optim": get_optimizer_state_dict(module, optimizer)},
             checkpoint_id=checkpoint_dir)


def load_named(checkpoint_dir: str, params: dict[str, nn.Parameter], optimizer: Optimizer,
                    weights: bool = True) -> None:
    """That checkpoint loaded through DCP into ``optimizer``, and into ``params`` with ``weights``
    (torch's ``get_optimizer_state_dict`` makes a fresh optimizer's state first, for DCP to load into)."""
    module = as_module(params)
    target = {"optim": get_optimizer_state_dict(module, optimizer)}
    if weights:
        target["model"] = module.state_dict()
    dcp.load(target, checkpoint_id=checkpoint_dir)
    if weights:
        module.load_state_dict(target["model"])
    set_optimizer_state_dict(module, optimizer, target["optim"])
