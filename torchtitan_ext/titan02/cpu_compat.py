"""CPU/gloo compatibility layer for TorchTitan 0.2.2: lets ``torchrun`` train on CPU.

This module is a *no-op when an accelerator exists* (``torch.accelerator``
reports one). On a CPU-only machine it patches the few places where TorchTitan
0.2.2 assumes CUDA, and works around one gloo shutdown crash. Nothing here changes
numerics; it only picks the CPU device, the gloo-compatible way to reduce
gradients, CPU versions of two MoE routing helpers that give the results their
GPU versions give, and how a finished process exits.

What it patches and why:

1. **Device selection.** ``torchtitan.tools.utils`` falls back to
   ``device_type = "cuda"`` when no accelerator is found, and several modules copy
   ``device_type`` / ``device_module`` at import time. The first symptom is
   ``module 'torch._C' has no attribute '_cuda_setDevice'``. We set them to
   ``"cpu"`` / a ``torch.cpu`` stand-in in every module that holds a copy.
   TorchTitan then also picks ``gloo`` as the process-group backend by itself.
   The stand-in differs from ``torch.cpu`` in one call: ``current_device()``
   returns the index 0 instead of the string ``"cpu"``, because TorchTitan passes
   it to ``dist.barrier(device_ids=[...])``, which only accepts integers (gloo
   ignores the value).
2. **Device memory monitor.** ``components.metrics.build_device_memory_monitor``
   queries CUDA memory statistics. We substitute a monitor that reports the
   process's peak resident memory (RSS) instead, so the step lines still show a
   meaningful "memory" figure.
3. **Gradient reduction.** TorchTitan sets FSDP2's gradient divide factor to 1.0
   (the loss is already normalised by the global token count), which makes FSDP2
   reduce-scatter with ``ReduceOp.PREMUL_SUM``; gloo rejects it (``Cannot use
   ReduceOp.PREMUL_SUM with Gloo``). ``wrap_parallelize_fn`` calls
   ``FSDPModule.set_force_sum_reduction_for_comms(True)`` after parallelisation,
   which reduces with a plain SUM -- mathematically the same with factor 1.0.
   ``train_specs.with_dmuon`` applies this wrapper to every spec it registers.

4. **Exit after a successful run.** ``clean_exit.install()``: a cleanly finished job ends
   with ``os._exit(0)`` before interpreter finalization, where gloo's worker threads
   could otherwise abort a finished rank with SIGABRT (pytorch/pytorch#190489; the
   whole story is in ``torchtitan_ext/clean_exit.py``).

5. **Counting tokens per expert (MoE).** The MoE router and token reorderer
   (``torchtitan.models.moe.moe``) count tokens per expert with ``torch.histc``
   on int64 expert indices; the CPU kernel has no integer version
   (``"histogram_cpu" not implemented for 'Long'``). We wrap ``torch.histc`` so
   that a plain integer CPU tensor is counted by ``integer_histc``, which gives
   the counts (and dtype) CUDA's integer ``histc`` gives. Every other call goes to
   the original function unchanged.
6. **Expert-parallel token permutation (MoE + EP).** After EP's all-to-all,
   ``models.moe.utils._permute`` orders the received tokens by local expert with
   ``generate_permute_indices``, whose default is a Triton kernel that cannot run
   on CPU tensors. TorchTitan ships a CPU reference implementation behind that
   function's ``use_cpu=True``; we rebind the name ``_permute`` looks up to a
   wrapper that asks for it when the counts live on the CPU. (Grouped mm needs no
   patch: the MoE model args switch to the per-expert for-loop without SM90.)

No TOML option fixes any of these, hence a code layer. ``apply()`` runs when the
job imports ``torchtitan_ext.titan02.job`` (``[experimental] custom_import``), at
the start of the Trainer, before it picks a device; never on import of the package.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch

from torchtitan.tools.logging import logger

from .. import clean_exit
from ..cpu_common import force_sum_reduction, needs_cpu_compat, point_torchtitan_at_cpu, wrap_parallelize_fn  # noqa: F401 (re-exported)
from ..integer_histc import HISTC_INTEGER_DTYPES, integer_histc
from ..versions import require_tested

# Modules that copy ``device_type`` / ``device_module`` at import time.
_MODULES_WITH_DEVICE_COPIES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiling",
)

_applied = False


def _histc_with_integer_cpu_support(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Patch 5: ``torch.histc`` that also counts plain integer CPU tensors."""

    @functools.wraps(original)
    def histc(input: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
        # Only the case the CPU kernel rejects; subclasses (DTensor, ...) keep their own dispatch.
        if type(input) is not torch.Tensor or input.device.type != "cpu" or input.dtype not in HISTC_INTEGER_DTYPES:
            return original(input, bins, min, max, out=out) if out is not None else original(input, bins, min, max)
        counts = integer_histc(input, bins, min, max)
        if out is None:
            return counts
        return out.resize_(counts.shape).copy_(counts)

    return histc


def _permute_indices_on_cpu_when_needed(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch 6: ``generate_permute_indices`` that uses TorchTitan's CPU version for CPU tensors."""

    @functools.wraps(original)
    def generate_permute_indices(tokens_per_expert_group: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # use_cpu is the 6th parameter; a caller that passes it positionally keeps its choice.
        if tokens_per_expert_group.device.type == "cpu" and len(args) < 5:
            kwargs["use_cpu"] = True
        return original(tokens_per_expert_group, *args, **kwargs)

    return generate_permute_indices


def _install_moe_patches() -> None:
    """Patches 5 and 6 (MoE models)."""
    torch.histc = _histc_with_integer_cpu_support(torch.histc)
    moe_utils = importlib.import_module("torchtitan.models.moe.utils")
    moe_utils.generate_permute_indices = _permute_indices_on_cpu_when_needed(moe_utils.generate_permute_indices)


def apply() -> None:
    """Install patches 1, 2, 4, 5 and 6 above on a CPU-only machine; do nothing otherwise."""
    global _applied
    if _applied or not needs_cpu_compat():
        return
    require_tested("0.2", "TorchTitan's device selection, memory monitor and MoE helpers (the CPU layer)")
    point_torchtitan_at_cpu(_MODULES_WITH_DEVICE_COPIES)
    clean_exit.install()
    _install_moe_patches()
    _applied = True
    logger.info("torchtitan_ext.titan02.cpu_compat: no accelerator found, running TorchTitan on CPU/gloo")
