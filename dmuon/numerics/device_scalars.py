"""Hyperparameters as 0-dim device tensors, for a step captured in a CUDA graph (``capturable=True``).

A captured graph replays the scalars it was captured with: a learning rate passed to a kernel
as a Python number would stay the first step's forever. Under ``capturable`` a group's
:data:`DEVICE_HYPERPARAMETERS` are 0-dim tensors on the parameters' device, which LR
schedulers update in place (``fill_``), and every product of them is computed on the device.

Why fp64 (:data:`HYPERPARAMETER_DTYPE`): a Python float is an fp64 number, and IEEE fp64
arithmetic rounds alike on the host and on every device. So ``1 - lr * weight_decay`` and
``-lr * scale`` computed on fp64 device tensors are the very numbers ``capturable=False``
computes on the host, and a kernel fed them (cast as that kernel casts its Python number)
gives the same bits.

The one kernel whose number has no Tensor form is ``add_(update, alpha=...)``.
``dmuon.numerics.update_lists.apply_muon_`` gives its bits with ``addcmul_`` and ``alpha`` as a
broadcast tensor, in the dtype ``add_`` reads its ``alpha`` in (:func:`alpha_dtype`). Checked bit for bit
against ``add_`` for fp32 and fp64 targets on the CPU (AVX-512, AVX2 and default kernels):
``tests/test_capturable.py``. On the CPU a bf16 or fp16 target's ``add_`` rounds
``alpha * update`` to the target's dtype in the elements its vector loop leaves over, bits of
where an element sits that a row shard cannot give: there ``capturable=False`` takes this
``addcmul_`` too (the vector loop's bits at every position), so both forms agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from typing import Any

import torch

# What a device hyperparameter is held in: a Python float's own format (see the module docstring).
HYPERPARAMETER_DTYPE = torch.float64
# The group keys held on the device under ``capturable``: what LR schedulers (and weight-decay
# schedules) change. The rest (momentum, betas, eps, ...) stay Python numbers, fixed at capture.
DEVICE_HYPERPARAMETERS = ("lr", "weight_decay")
# Targets whose ``add_(alpha=)`` on the CPU reads ``alpha`` in their own dtype (not fp32).
_NARROW = (torch.bfloat16, torch.float16)


def device_scalar(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` (a number or a one-element Tensor) as a 0-dim fp64 tensor on ``device``;
    made once, when a group is built or loaded, never in a step."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=HYPERPARAMETER_DTYPE, copy=True)
    return torch.tensor(float(value), dtype=HYPERPARAMETER_DTYPE, device=device)


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype an elementwise op by a Python number computes in for ``dtype`` tensors:
    fp64 for fp64 (and complex128), fp32 for the rest."""
    return torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32


def alpha_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype ``add_(other, alpha=a)`` on a ``dtype`` tensor reads ``a`` in: fp64 for
    fp64; on the CPU a bf16 or fp16 tensor's own dtype; else fp32 (CUDA's opmath)."""
    if dtype == torch.float64:
        return torch.float64
    if device_type == "cpu" and dtype in _NARROW:
        return dtype
    return torch.float32


def keep_of(lr: Any, weight_decay: Any) -> Any:
    """The one place the decay's keep factor is written: ``1 - lr * weight_decay``, of numbers
    or of 0-dim tensors (on the host or the device: the same arithmetic, the same bits)."""
    return 1 - lr * weight_decay


class StepScalars:
    """One step's scalars, each made once and reused for every tensor that needs it (the
    per-tensor forms would otherwise make them per tensor): the device products of
    ``capturable`` hyperparameters (``1 - lr * weight_decay``, ``-lr * scale``) and their
    casts, the masked decay factors, and numbers made 0-dim tensors. Valid for one step (the
    values change between steps; the tensors they are made of do not). The factors are
    chosen by ``dmuon.numerics.update_lists.decay_factor``; this class only keeps them."""

    def __init__(self) -> None:
        self._made: dict[tuple, torch.Tensor] = {}
        self._sources: list[torch.Tensor] = []  # kept alive: their ids are the keys

    def _once(self, key: tuple, sources: tuple[torch.Tensor, ...], make) -> torch.Tensor:
        if key not in self._made:
            self._made[key] = make()
            self._sources.extend(sources)
        return self._made[key]

    def keep(self, lr: torch.Tensor, weight_decay: torch.Tensor) -> torch.Tensor:
        """:func:`keep_of` these device hyperparameters (fp64, on the device), made once."""
        return self._once(("keep", id(lr), id(weight_decay)), (lr, weight_decay), lambda: keep_of(lr, weight_decay))

    def alpha(self, lr: torch.Tensor, scale: float) -> torch.Tensor:
        """``-lr * scale`` (fp64, on the device), as the host computes it."""
        return self._once(("alpha", id(lr), scale), (lr,), lambda: -lr * scale)

    def cast(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``value`` (one made here, or a group's tensor) in ``dtype``."""
        return self._once(("cast", id(value), dtype), (value,), lambda: value.to(dtype))

    def on_host(self, value: float, dtype: torch.dtype) -> torch.Tensor:
        """The number ``value`` as a 0-dim ``dtype`` tensor on the CPU (a scalar every device reads)."""
        return self._once(("host", value, dtype), (), lambda: torch.tensor(value, dtype=dtype))

    def filled(self, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The number ``value`` as a 0-dim ``dtype`` tensor on ``device``, filled there (no copy from the host)."""
        return self._once(("filled", value, dtype, device), (), lambda: torch.full((), value, dtype=dtype, device=device))

    def masked(self, value: float | torch.Tensor, dtype: torch.dtype, ok: torch.Tensor) -> torch.Tensor:
        """``value`` (a number, or a device tensor) where the 0-dim bool ``ok`` holds, exactly 1
        elsewhere, in ``dtype`` on ``ok``'s device (a masked decay's factor)."""
        tensor = isinstance(value, torch.Tensor)

        def make() -> torch.Tensor:
            kept = value.to(dtype) if tensor else torch.full((), value, dtype=dtype, device=ok.device)
            return torch.where(ok, kept, torch.ones((), dtype=dtype, device=ok.device))

        return self._once(("masked", id(value) if tensor else value, dtype, id(ok)), (ok, value) if tensor else (ok,),
                          make)
