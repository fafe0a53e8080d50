"""Spoil or drop one optimizer step of a TorchTitan run with DMuon (for tests).

- ``TORCHTITAN_EXT_NAN_GRAD=STEP:RANK``: at training step STEP, rank RANK writes a NaN into
  one element of its first non-empty local grad, just before the optimizer steps (every
  other rank's grads stay as they are);
- ``TORCHTITAN_EXT_NO_OPTIMIZER_STEP=STEP``: at training step STEP no rank calls the
  optimizer at all; TorchTitan's LR scheduler and data loader go on as ever. This is the
  reference of a run that never had that step's update.

Both wrap ``DMuonOptimizersContainer.step``, called once per training step.
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

NAN_ENV, NO_STEP_ENV = "TORCHTITAN_EXT_NAN_GRAD", "TORCHTITAN_EXT_NO_OPTIMIZER_STEP"


def _poison(container: Any) -> None:
    for optimizer in container.optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                local = grad._local_tensor if isinstance(grad, DTensor) else grad
                if local is not None and local.numel():
                    local.view(-1)[0] = float("nan")
                    return
    raise RuntimeError("grad_fault: no non-empty grad on this rank to poison")


def install_from_env() -> None:
    nan, no_step = os.environ.get(NAN_ENV), os.environ.get(NO_STEP_ENV)
    if not (nan or no_step):
        return
    from torchtitan_ext.titan02.container import DMuonOptimizersContainer

    original = DMuonOptimizersContainer.step
    calls = itertools.count(1)

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        n = next(calls)
        if no_step and n == int(no_step):
            return None
        if nan:
            at, rank = map(int, nan.split(":"))
            if n == at and dist.get_rank() == rank:
                with torch.no_grad():
                    _poison(self)
        return original(self, *args, **kwargs)

    DMuonOptimizersContainer.step = step
