"""Memory measured from the tensors a process holds, not from what an optimizer reports of
itself: the storages of every live tensor (:func:`live_storages`), an optimizer state's
(:func:`state_storages`), and the most bytes a block of code held above what existed
before it (:class:`PeakBytes`). For CPU runs, where no allocator counts bytes; the dry run
(``dmuon.tools.dry_run``) does the same for fake CUDA tensors.

Tensors only C++ holds (autograd nodes, a gloo work a moment after its ``wait()``) are not
seen by :func:`live_storages`; :class:`PeakBytes` sees every storage an op returns.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dmuon.tools import TorchDispatchMode


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the storage under ``tensor`` (a DTensor's local tensor's), or None
    for one without memory (meta, fake, empty, sparse)."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    try:
        if local.device.type == "meta" or type(local).__name__ == "FakeTensor":
            return None
        storage = local.untyped_storage()
        return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None
    except Exception:  # noqa: BLE001 - sparse and other storage-less tensors
        return None


def live_storages() -> dict[int, tuple[int, torch.Tensor]]:
    """Address -> (bytes, a tensor on it) for every live tensor ``gc`` sees (a DTensor's local
    tensor for it), one entry a storage."""
    found: dict[int, tuple[int, torch.Tensor]] = {}
    with warnings.catch_warnings():  # some torch module objects warn when their class is read
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        key = storage_key(obj)
        if key is not None and key[0] not in found:
            found[key[0]] = (key[1], obj._local_tensor if isinstance(obj, DTensor) else obj)
    return found


def state_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    """The addresses of the storages an optimizer's state holds."""
    return {key[0] for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor) and (key := storage_key(value)) is not None}


class PeakBytes(TorchDispatchMode):
    """Inside ``with PeakBytes() as peak:``, every storage an op makes is counted until Python
    frees it; ``peak.bytes`` is the most they held at once (what the block needed above what
    existed before it)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self._live: dict[int, int] = {}
        self._live_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs)) if t.device.type != "meta"}
        out = func(*args, **kwargs)
        for tensor in _tensors(out):  # a view or an in-place op's result is an input's storage
            if tensor.device.type != "meta" and id(storage := tensor.untyped_storage()) not in inputs:
                self._count(storage)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._live or not storage.nbytes():
            return
        self._live[key] = storage.nbytes()
        self._live_bytes += storage.nbytes()
        self.bytes = max(self.bytes, self._live_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self._live_bytes -= self._live.pop(key, 0)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (nested lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
