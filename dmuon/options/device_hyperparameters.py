"""A capturable group's ``lr`` and ``weight_decay`` stay what the step reads: 0-dim fp64
tensors on the group's device (``dmuon.numerics.device_scalars``), the same tensor objects
for the optimizer's life, so that a step captured in a CUDA graph reads what a scheduler
writes into them (``fill_``).

Two things can put something else there, and both are mended here, outside the kernels:

- ``load_state_dict`` hands each group the saved values (floats from a run without
  ``capturable``, tensors on the host from a checkpoint): :func:`keep_after_load` copies them
  into the group's own tensors; a group without ``capturable`` gets numbers back where it
  had numbers;
- code that assigns a number or another tensor (``torch.distributed.checkpoint``'s state
  initialization sets ``lr`` to a CPU ``torch.tensor(0.0)`` for one step):
  :func:`place_on_device` makes a device tensor of it at the next step (eagerly: a capture
  would see a host copy; ``dmuon.capture.cuda_graphs`` refuses to replay a graph whose tensors were
  replaced).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dmuon.numerics.device_scalars import DEVICE_HYPERPARAMETERS, HYPERPARAMETER_DTYPE, device_scalar
from dmuon.torch_compat import local_of

# Group values an LR scheduler derives from ``lr``: kept as numbers where the group had numbers.
SCHEDULER_VALUES = ("initial_lr",)

Groups = Sequence[dict[str, Any]]


def place_on_device(param_groups: Groups) -> None:
    """Each capturable group's hyperparameters as 0-dim fp64 tensors on its device (those
    already so are left as they are: the usual case, a few host checks a group)."""
    for group in param_groups:
        if not group.get("capturable"):
            continue
        device = local_of(group["params"][0]).device  # its first parameter's (local tensor's)
        for key in DEVICE_HYPERPARAMETERS:
            value = group[key]
            if not (isinstance(value, torch.Tensor) and value.dtype == HYPERPARAMETER_DTYPE and value.ndim == 0
                    and value.device == device):
                group[key] = device_scalar(value, device)


def held_values(param_groups: Groups) -> list[dict[str, Any]]:
    """The groups' hyperparameters before a load (what :func:`keep_after_load` keeps)."""
    return [{key: group[key] for key in (*DEVICE_HYPERPARAMETERS, *SCHEDULER_VALUES) if key in group}
            for group in param_groups]


def keep_after_load(param_groups: Groups, held: list[dict[str, Any]]) -> None:
    """After torch's load: a capturable group's loaded values copied into its own device
    tensors (which stay in the group); elsewhere a loaded tensor becomes a number again
    where the group had a number (a checkpoint written with ``capturable``, resumed without)."""
    for group, mine in zip(param_groups, held):
        for key, before in mine.items():
            loaded = group.get(key)
            if group.get("capturable") and key in DEVICE_HYPERPARAMETERS and isinstance(before, torch.Tensor):
                if isinstance(loaded, torch.Tensor):
                    before.copy_(loaded.detach().reshape(()))
                else:
                    before.fill_(float(loaded))
                group[key] = before
            elif not isinstance(before, torch.Tensor) and isinstance(loaded, torch.Tensor):
                group[key] = loaded.item()
    place_on_device(param_groups)  # a group that was not capturable when saved
