"""Write the state TorchTitan just loaded from a checkpoint to a file (for tests).

A resume test that only watches the loss cannot tell a correctly loaded
optimizer from a zeroed one for a step or two. With

    TORCHTITAN_EXT_DUMP_LOADED_STATE=/some/file.pt

set, ``tests.titan_hooks.job`` wraps ``CheckpointManager.load``: right after a
checkpoint is loaded, and before any training step, rank 0 writes
``{"model": {...}, "optimizer": {...}}`` to that file with ``torch.save``. The
values are the *full* tensors (DTensor shards gathered), under the same flat
keys TorchTitan's checkpoint uses, so a test can compare them bit for bit with
the checkpoint as saved. Nothing is written when no checkpoint was loaded.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.tools.logging import logger

ENV_VAR = "TORCHTITAN_EXT_DUMP_LOADED_STATE"


def _full(value: Any) -> Any:
    # full_tensor() is a collective on the DTensor's mesh: every rank calls it.
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value


def install(path: str) -> None:
    from torchtitan.components.checkpoint import CheckpointManager, MODEL, OPTIMIZER

    original_load: Callable[..., bool] = CheckpointManager.load

    @functools.wraps(original_load)
    def load(self: CheckpointManager, *args: Any, **kwargs: Any) -> bool:
        loaded = original_load(self, *args, **kwargs)
        if loaded:
            state = {"model": _full(self.states[MODEL].state_dict()),
                     "optimizer": _full(self.states[OPTIMIZER].state_dict())}
            if not dist.is_initialized() or dist.get_rank() == 0:
                torch.save(state, path)
                logger.info(f"torchtitan_ext: wrote the loaded model and optimizer state to {path}")
        return loaded

    CheckpointManager.load = load


def install_from_env() -> None:
    if path := os.environ.get(ENV_VAR):
        install(path)
