"""How a finished CPU TorchTitan job exits: ``os._exit(0)`` before interpreter finalization.

Both lines' CPU layers (``titan02/cpu_compat.py`` patch 4, ``titan03/cpu_compat.py``
patch 5) call ``install()``.

Why: gloo runs each collective on a worker thread of its ``ProcessGroupGloo``. A worker
drops its reference to a finished collective only *after* the caller's ``wait()`` has
returned, and those threads outlive ``destroy_process_group()`` (gloo's ``shutdown()``
does not stop them; pytorch/pytorch#130345). When that late reference is the last one
to a tensor Python has already let go of, the worker must take the GIL to free the
tensor's Python object. If the main thread has meanwhile begun interpreter
finalization, CPython 3.11 ends the worker with ``pthread_exit`` inside a C++ destructor
and the process dies with ``terminate called without an active exception`` / ``Fatal
Python error: Aborted`` (SIGABRT) after training finished -- on a rank other than 0,
since TorchTitan makes rank 0 sleep 2 s before exiting (pytorch/pytorch#190489). A core
dump of such a rank shows exactly that stack: ``ProcessGroupGloo::runLoop`` ->
``~AsyncAllreduceWork`` -> ``THPVariable_dealloc`` -> ``take_gil`` -> ``pthread_exit``
-> ``std::terminate``. Seen with torch 2.13 and TorchTitan 0.2.2, and with torch 2.15
and TorchTitan 0.3.0 (a 4-rank HSDP run in CI).

The process groups are still referenced from C++ at exit (``gc.collect()`` frees none of
them), so they cannot be freed -- and their threads joined -- early. Instead an
``atexit`` handler, which runs before finalization begins, flushes the output and ends a
cleanly finished run with ``os._exit(0)``: with no finalization, no thread is ever told
to exit. It acts only when ``__main__`` is a ``torchtitan`` module, the process group was
destroyed (TorchTitan's ``main`` does that only after training succeeded) and no
exception escaped; any other exit is left alone.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

import torch.distributed as dist

__all__ = ["install", "torchtitan_finished_cleanly"]

_installed = False


def torchtitan_finished_cleanly() -> bool:
    """True at exit of a TorchTitan job whose ``main`` completed."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (
        spec is not None
        and spec.name.startswith("torchtitan.")
        and dist.is_available()
        and not dist.is_initialized()  # TorchTitan destroys the group only on success
        and not hasattr(sys, "last_value")  # set when an exception ended the program
    )


def _exit_before_finalization() -> None:
    if not torchtitan_finished_cleanly():
        return
    logging.shutdown()  # flush log handlers, as finalization would have
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def install() -> None:
    """Register the exit handler once per process (idempotent)."""
    global _installed
    if not _installed:
        atexit.register(_exit_before_finalization)
        _installed = True
