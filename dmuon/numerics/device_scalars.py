"""Hyperparameters as 0-dim device tensors, for a step captured in a CUDA graph
(``capturable=True``).

A captured graph replays the numbers it was captured with, so under ``capturable`` a group's
:data:`DEVICE_HYPERPARAMETERS` are 0-dim tensors on the parameters' device that LR schedulers
``fill_``, and every product of them is made on the device once a step (:class:`StepScalars`).
In fp64, a Python float's format: IEEE fp64 rounds alike on the host and every device, so
``1 - lr * weight_decay`` and ``-lr * scale`` are the numbers ``capturable=False`` computes, and a
kernel fed them gives the same bits (``add_``'s ``alpha`` has no Tensor form: ``apply_muon_`` gives
its bits with ``addcmul_``, checked in ``tests/test_capturable.py``).
"""

from __future__ import annotations

import torch

# What a device hyperparameter is held in: a Python float's own format (see the module docstring).
HYPERPARAMETER_DTYPE = torch.float64
# The group keys held on the device under ``capturable`` (what schedulers change); the
# rest stay numbers.
DEVICE_HYPERPARAMETERS = ("lr", "weight_decay")


def device_scalar(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` (a number or a one-element Tensor) as a 0-dim fp64 tensor on ``device``
    (never in a step)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=HYPERPARAMETER_DTYPE, copy=True)
    return torch.tensor(float(value), dtype=HYPERPARAMETER_DTYPE, device=device)


class StepScalars:
    """One step's scalars, each made once for every tensor that needs it: the device
    products of ``capturable`` hyperparameters and their casts, masked decay factors,
    numbers as 0-dim tensors."""

    def __init__(self) -> None:
        self._made: dict[tuple, torch.Tensor] = {}
        self._sources: list[torch.Tensor] = []  # kept alive: their ids are the keys

    def _once(self, key: tuple, sources: tuple[torch.Tensor, ...], make) -> torch.Tensor:
        if key not in self._made:
            self._made[key] = make()
            self._sources.extend(sources)
        return self._made[key]

    def keep(self, lr: torch.Tensor, weight_decay: torch.Tensor) -> torch.Tensor:
        """``1 - lr * weight_decay`` (fp64, on the device), as the host computes it."""
        return self._once(("keep", id(lr), id(weight_decay)), (lr, weight_decay), lambda: 1 - lr * weight_decay)

    def alpha(self, lr: torch.Tensor, scale: float) -> torch.Tensor:
        """``-lr * scale`` (fp64, on the device), as the host computes it."""
        return self._once(("alpha", id(lr), scale), (lr,), lambda: -lr * scale)

    def cast(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``value`` (one made here, or a group's tensor) in ``dtype``."""
        return self._once(("cast", id(value), dtype), (value,), lambda: value.to(dtype))

    def on_host(self, value: float, dtype: torch.dtype) -> torch.Tensor:
        """The number ``value`` as a 0-dim ``dtype`` tensor on the CPU (a scalar every
        device reads)."""
        return self._once(("host", value, dtype), (), lambda: torch.tensor(value, dtype=dtype))

    def filled(self, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The number ``value`` as a 0-dim ``dtype`` tensor filled on ``device`` (no copy
        from the host)."""
        return self._once(("filled", value, dtype, device), (),
                          lambda: torch.full((), value, dtype=dtype, device=device))

    def masked(self, value: float | torch.Tensor, dtype: torch.dtype, ok: torch.Tensor) -> torch.Tensor:
        """``value`` where the 0-dim bool ``ok`` holds, exactly 1 elsewhere, in ``dtype`` on
        ``ok``'s device."""
        tensor = isinstance(value, torch.Tensor)

        def make() -> torch.Tensor:
            kept = value.to(dtype) if tensor else torch.full((), value, dtype=dtype, device=ok.device)
            return torch.where(ok, kept, torch.ones((), dtype=dtype, device=ok.device))

        return self._once(("masked", id(value) if tensor else value, dtype, id(ok)), (ok, value) if tensor else (ok,),
                          make)
