"""What both TorchTitan lines' CPU layers use: a CPU stand-in for the device module, a
memory monitor that reports peak RSS, and gloo-safe gradient reduction.

Nothing here patches anything; each line's ``cpu_compat`` decides where these go
(``titan02/cpu_compat.py``, ``titan03/cpu_compat.py``).
"""

from __future__ import annotations

import functools
import importlib
import os
import resource
from typing import Any, Callable

import torch
import torch.nn as nn

from torchtitan.tools.logging import logger


class CPUDeviceModule:
    """``torch.cpu`` with an integer ``current_device()``: TorchTitan passes it to
    ``dist.barrier(device_ids=[...])``, which takes integers only (gloo ignores it)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


def needs_cpu_compat() -> bool:
    """True on a machine without any accelerator (CUDA, ROCm, XPU, MPS, ...)."""
    return not torch.accelerator.is_available()


class _CPUMemoryMonitor:
    """Stands in for ``DeviceMemoryMonitor``: reports the peak RSS of this process."""

    def __init__(self) -> None:
        self.device_name = "CPU"
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 2**30

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        gib, pct = peak / 2**30, 100 * peak / self.device_capacity
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        pass  # the kernel's peak RSS cannot be reset; it stays a whole-run peak


def build_cpu_memory_monitor() -> _CPUMemoryMonitor:
    monitor = _CPUMemoryMonitor()
    logger.info(f"CPU memory: {monitor.device_capacity_gib:.2f}GiB (reporting peak RSS)")
    return monitor


def force_sum_reduction(model: nn.Module) -> None:
    """Make every FSDP2 module of ``model`` reduce gradients with SUM (gloo-safe)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def wrap_parallelize_fn(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``parallelize_fn`` followed by ``force_sum_reduction`` on CPU (gloo rejects
    the ``PREMUL_SUM`` FSDP2 reduces with when TorchTitan sets the divide factor to 1).

    Returns ``parallelize_fn`` itself when an accelerator exists.
    """
    if not needs_cpu_compat():
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def parallelize_then_force_sum(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        model = parallelize_fn(model, *args, **kwargs)
        force_sum_reduction(model)
        return model

    return parallelize_then_force_sum


def point_torchtitan_at_cpu(modules_with_device_copies: tuple[str, ...]) -> None:
    """Make TorchTitan pick the CPU: set ``device_type`` / ``device_module`` in every module
    that copied them at import (TorchTitan falls back to ``"cuda"`` without an accelerator),
    and replace its CUDA memory monitor with ``build_cpu_memory_monitor``. Each line lists
    its own modules; this is the patch both lines' CPU layers install."""
    for name in modules_with_device_copies:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = CPUDeviceModule()
    metrics = importlib.import_module("torchtitan.components.metrics")
    metrics.build_device_memory_monitor = build_cpu_memory_monitor
