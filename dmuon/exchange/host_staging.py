"""FSDP2's CPU offload: the step's tensors stay on the host, the exchange runs on the device.

Under ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` (TorchTitan's
``training.enable_cpu_offload``) a parameter's local shard, its grad and DMuon's state
are host tensors while its mesh is a device mesh. Every elementwise rule runs where those
tensors are (on the host, as torch's AdamW does under the offload); the owner exchange,
Newton-Schulz and the small all-reduces run on the mesh's device. What crosses goes through
a pinned host buffer kept per key (a batch, a unit, a NorMuon state), reused step to step:
up, packed into it and copied non-blocking to the device; down, copied non-blocking into
it, then a wait, as the host is about to compute with it. The waits are the offload's by
nature, one each (docs/dry_run.md, "CPU offload"): the step's masks, before the masked
momentum; each batch's results this rank receives; each unit this rank holds whole and
keeps; NorMuon's rows, once shared; QK-clip's row factors (``dmuon.attention.clipping``).

A wait waits for the device's current stream, so the first of a step (the masks) also
finishes every upload of the previous step: a host buffer is written again only after
the copy that read it. Each wait is announced to the listeners of :func:`listening`
(the dry run's recorder counts them; a fake tensor has nothing to wait for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from dmuon.exchange.comm import ScratchMeter, track
from dmuon.torch_compat import is_fake, local_of

FORCE = False
"""Stage every fast path, also one whose tensors are on the mesh's device: a gloo test runs
this same code with host buffers on both sides (tests)."""
MASKS, RESULTS, KEPT, NORMUON_ROWS = "masks", "batch results", "kept unit result", "NorMuon rows"
# The step's mask for an AdamW part on the host (``dmuon.step.adamw_part``): one wait a step.
ADAMW_MASK = "AdamW mask"
QK_CLIP_FACTORS = "QK-clip factors"
"""The kinds of wait, as :func:`listening` reports them."""
_listeners: list[Callable[[str], None]] = []


@contextmanager
def listening(listener: Callable[[str], None]) -> Iterator[None]:
    """Call ``listener(kind)`` at every wait of the offload while in the block."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def staging_for(host: torch.device, device: torch.device) -> HostStaging | None:
    """The staging of a fast path whose local tensors are on ``host`` and whose mesh is on
    ``device``: None where they are on the same device (unless :data:`FORCE`)."""
    return HostStaging(device) if host.type != device.type or FORCE else None


def check_offload(paths: Mapping[torch.Tensor, str], fast: str, name_of: Callable[[torch.Tensor], str]) -> None:
    """Refuse, naming the parameters, an offload the staging does not cover: the fast path
    (``paths[p] == fast``) stages all of its parameters or none, and no other path stages."""
    offloaded = {p: isinstance(p, DTensor) and local_of(p).device.type != p.device_mesh.device_type for p in paths}
    fast_ones = [p for p, path in paths.items() if path == fast]
    if len({offloaded[p] for p in fast_ones}) > 1:
        host = [name_of(p) for p in fast_ones if offloaded[p]]
        raise ValueError(f"DMuon: Muon parameters {host} are offloaded to the host (FSDP2's CPUOffloadPolicy) and "
                         f"{[name_of(p) for p in fast_ones if not offloaded[p]]} are not; offload every sharded "
                         "module's parameters or none (TorchTitan's training.enable_cpu_offload does all)")
    if elsewhere := [f"{name_of(p)} ({paths[p]})" for p in paths if offloaded[p] and paths[p] != fast]:
        raise ValueError(f"DMuon: offloaded Muon parameters {elsewhere} take a path that does not stage through the "
                         "host; shard them with FSDP2's fully_shard (Shard(0)), or pass use_muon=False for them")


class HostStaging:
    """One fast path's host buffers, and its copies up and down (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type != "cpu"  # pinned memory needs an accelerator
        self._buffers: dict[object, torch.Tensor] = {}

    def buffer(self, key: object, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer of ``key``: ``numel`` elements of ``dtype``, made once, pinned
        where the device is an accelerator."""
        host = self._buffers.get(key)
        if host is None or host.numel() != numel or host.dtype != dtype:
            host = self._buffers[key] = torch.empty(numel, dtype=dtype, pin_memory=self._pin)
        return host

    def up(self, host: torch.Tensor, meter: ScratchMeter | None = None) -> torch.Tensor:
        """A device copy of ``host`` (one of :meth:`buffer`'s), non-blocking, tracked by
        ``meter``."""
        device = track(meter, torch.empty(host.shape, dtype=host.dtype, device=self.device))
        return device.copy_(host, non_blocking=True)

    def put(self, key: object, tensor: torch.Tensor, meter: ScratchMeter | None = None) -> torch.Tensor:
        """A host tensor on the device, through ``key``'s buffer, in its shape."""
        host = self.buffer(key, tensor.numel(), tensor.dtype)
        host.view(tensor.shape).copy_(tensor)
        return self.up(host, meter).view(tensor.shape)

    def down(self, key: object, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """A device tensor on the host (a view of ``key``'s buffer, in its shape), waited for."""
        host = self.buffer(key, tensor.numel(), tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        self.wait(kind, tensor)
        return host

    def masks(self, oks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The step's 0-dim device masks as 0-dim host bools: one copy, one wait."""
        return list(self.down(MASKS, torch.stack(list(oks)), MASKS).unbind()) if oks else []

    def moments_up(self, moments: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """NorMuon's host rows on the device, for the owners to read and write."""
        return {j: self.put((NORMUON_ROWS, j), moment) for j, moment in moments.items()}

    def moments_down(self, staged: Mapping[int, torch.Tensor], moments: Mapping[int, torch.Tensor]) -> None:
        """The shared rows back into the host state: one copy each, one wait."""
        hosts = {j: self.buffer((NORMUON_ROWS, j), m.numel(), m.dtype).view(m.shape) for j, m in staged.items()}
        for j, moment in staged.items():
            hosts[j].copy_(moment, non_blocking=True)
        if staged:
            self.wait(NORMUON_ROWS, next(iter(staged.values())))
        for j, moment in moments.items():
            moment.copy_(hosts[j])

    def wait(self, kind: str, tensor: torch.Tensor) -> None:
        """Wait for the device (its current stream), and tell the listeners."""
        for listener in _listeners:
            listener(kind)
        if tensor.device.type != "cpu" and not is_fake(tensor):
            torch.get_device_module(tensor.device).current_stream(tensor.device).synchronize()
