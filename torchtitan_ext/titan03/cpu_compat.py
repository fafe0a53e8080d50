"""CPU/gloo layer for TorchTitan 0.3.0: what a CPU-only ``torchrun`` job needs to train.

Nothing happens at import. ``CpuTrainer`` (``cpu_trainer.py``) calls ``install()`` at the
start of the job, before TorchTitan picks its device, and only when torch sees no
accelerator; ``wrap_parallelize_fn`` is put into the model spec by the config functions
(``configs.py``) and is the identity with an accelerator.

What 0.3.0 still needs on CPU (each found by running the 2-rank debug job), and why:

1. **Device selection** (patch). ``torchtitan.tools.utils`` sets ``device_type = "cuda"``
   when no accelerator is found, and ``components.metrics``, ``distributed.utils``,
   ``distributed.parallel_dims``, ``models.common.token_dispatcher`` and
   ``tools.profiler`` copy it at import. ``install`` sets ``"cpu"`` and a ``torch.cpu``
   stand-in whose ``current_device()`` is 0 (``dist.barrier(device_ids=...)`` wants an
   int; plain ``torch.cpu`` fails there with a ``TypeError``) in each; TorchTitan then
   chooses gloo itself. Without it: "Found no NVIDIA driver on your system".
2. **Memory monitor** (patch). ``components.metrics.build_device_memory_monitor`` asks
   the device module for memory statistics (without it: "module 'torch.cpu' has no
   attribute 'get_device_name'"); on CPU it reports the process's peak RSS instead.
3. **Gradient reduction** (model-spec wrapper, no patch). TorchTitan sets FSDP2's
   gradient divide factor to 1.0, so FSDP2 reduce-scatters with ``PREMUL_SUM``, which
   gloo rejects ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); ``wrap_parallelize_fn``
   switches every FSDP module to a plain SUM, the same result with factor 1.0.
4. **Attention** (config, no patch): ``cpu_attention.CpuBlockCausalAttention``.
5. **Exit after a successful run** (``atexit`` handler): ``clean_exit.install()``, the
   0.2.x layer's guard against gloo's worker threads aborting a finished rank with
   SIGABRT during interpreter finalization (pytorch/pytorch#190489; the whole story is in
   ``torchtitan_ext/clean_exit.py``). Ten clean 2-rank runs once suggested 0.3.0 with
   torch 2.15 did without it; then a 4-rank HSDP run in CI aborted on rank 2 after its
   last step.

Not needed with TorchTitan 0.3.0: the 0.2.x MoE patches (an integer ``torch.histc`` and the CPU
``generate_permute_indices``): 0.3.0's MoE (``models/common/moe.py``,
``token_dispatcher.py``) calls neither, and qwen3's MoE debug model trains on this layer
with expert parallelism 2 (``tests/test_titan03_layouts.py``).
"""

from __future__ import annotations

from torchtitan.tools.logging import logger

from .. import clean_exit
from ..cpu_common import needs_cpu_compat, point_torchtitan_at_cpu, wrap_parallelize_fn
from ..versions import require_tested

__all__ = ["install", "installed", "needs_cpu_compat", "wrap_parallelize_fn"]

# TorchTitan 0.3.0 modules that copy ``device_type`` / ``device_module`` at import time.
MODULES_WITH_DEVICE_COPIES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
)

_installed = False


def installed() -> bool:
    """True once ``install`` has patched this process."""
    return _installed


def install() -> bool:
    """Install patches 1, 2 and 5 on a CPU-only machine; return whether they are in place.

    Idempotent; does nothing (and returns False) when an accelerator exists.
    """
    global _installed
    if _installed:
        return True
    if not needs_cpu_compat():
        return False
    require_tested("0.3", "TorchTitan's device selection and memory monitor (the 0.3 CPU layer)")
    point_torchtitan_at_cpu(MODULES_WITH_DEVICE_COPIES)
    clean_exit.install()
    _installed = True
    logger.info("torchtitan_ext.titan03.cpu_compat: no accelerator found, running TorchTitan on CPU/gloo")
    return True
