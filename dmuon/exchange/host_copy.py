"""Small host facts to the device and small device results back, without a host sync.

A step must never wait for the device (the GPU may still be running the backward when
``step()`` is called), yet its collectives need a few host facts on the device, and its
errors need a few device sums on the host. Both go through pinned memory with
non-blocking copies: up before the collective that uses them, down to be read one step
later, behind an event that has long completed by then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.torch_compat import is_fake


class HostCopy:
    """A small device tensor on its way to the host (module docstring); reading waits for the
    event recorded behind its copy. A fake tensor (the dry run) is copied, never read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        self.in_graph = False
        """Made while a CUDA graph was captured: every replay copies again into the same
        pinned memory, and a reader waits for the replay itself (``dmuon.capture.cuda_graphs``)."""
        if tensor.device.type == "cpu":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        if is_fake(tensor):  # the dry run: nothing to wait for, or to read
            return
        self.in_graph = tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not self.in_graph:  # an event recorded in a capture cannot be waited on
            self._event = torch.get_device_module(tensor.device).Event()
            self._event.record()

    def deferred(self) -> bool:
        """Whether it must be read later: a CUDA graph is being captured (this copy, made in
        it, holds values only once the graph is replayed; waiting is not allowed then)."""
        return (self._event is not None or self.in_graph) and torch.cuda.is_current_stream_capturing()

    def read(self) -> list[int] | None:
        """The values (None for a fake tensor, which has none)."""
        if is_fake(self._host):
            return None
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Host integers on ``device`` without a host sync: through pinned memory, non-blocking."""
    host = torch.tensor(list(values), dtype=dtype)
    if device.type == "cpu":
        return host
    pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)
