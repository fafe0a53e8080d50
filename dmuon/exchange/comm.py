"""Move the blocks of an :class:`~dmuon.plan.OwnerPlan` with collectives: one batch is two
``all_to_all_single`` calls (gather, scatter: ``dmuon.plan.owner_plan``) on flat bf16 buffers.

Packing (``dmuon.exchange.packing``) is plain tensor code, separate from the collective
here, so it can be tested by routing buffers between simulated ranks in one process (also
on the ``meta`` device). Every buffer is created on the mesh's device: NCCL rejects a CPU
tensor where gloo would quietly accept it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon.numerics.newton_schulz import UPDATE_DTYPE as WIRE_DTYPE


@dataclass
class CommStats:
    """What this rank's fast path sent, summed over steps."""

    bytes_sent: int = 0
    """Bytes sent to other ranks (the share a rank keeps for itself does not count)."""
    collectives: int = 0
    """Number of ``all_to_all_single`` calls."""
    ns_flops: int = 0
    """Newton-Schulz flops run on this rank (every path), as ``newton_schulz_flops`` counts them."""


class ScratchMeter:
    """Live and peak bytes of the scratch tensors the step's schedule holds: ``track(t)`` where
    the step makes one, ``free(t)`` where the schedule lets go of it, so ``peak_bytes`` is
    exactly the plan's ``peak_scratch_bytes``. (Counting Python object lifetimes would be
    racy: gloo's and NCCL's workers release a collective's tensors a moment after ``wait()``.)
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self._sizes[id(tensor)] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        self.live_bytes -= self._sizes.pop(id(tensor))

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's buffers for ``mesh`` live on (``cuda:<current>`` for CUDA)."""
    if mesh.device_type in ("cpu", "meta"):
        return torch.device(mesh.device_type)
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


class Exchange:
    """An ``all_to_all_single`` in flight: ``wait()`` hands over the receive buffer. Both
    buffers are checked to be on the mesh's device type before the collective, so a wrong
    device fails here, with a message, on every backend."""

    def __init__(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                 group: dist.ProcessGroup, group_rank: int, stats: CommStats, device: torch.device,
                 meter: ScratchMeter | None = None) -> None:
        self.send_splits, self.recv_splits = send_splits, recv_splits
        recv = track(meter, torch.empty(sum(recv_splits), dtype=WIRE_DTYPE, device=device))
        for name, buffer in (("send", send), ("receive", recv)):
            if buffer.device.type != device.type:
                raise RuntimeError(
                    f"DMuon: the all_to_all {name} buffer is on {buffer.device}, but the mesh's device is "
                    f"{device.type}: every buffer must live on the mesh's device"
                )
        self._send: torch.Tensor | None = send  # kept alive until the collective is done
        self._recv: torch.Tensor | None = recv
        self._meter = meter
        self._work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
        stats.collectives += 1
        stats.bytes_sent += (sum(send_splits) - send_splits[group_rank]) * send.element_size()

    def wait(self) -> torch.Tensor:
        """Wait, free the send buffer, and return the receive buffer (only once)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        free(self._meter, self._send)
        self._send = None
        recv, self._recv = self._recv, None
        if recv is None:
            raise RuntimeError("Exchange.wait() was called twice")
        return recv


def track(meter: ScratchMeter | None, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if meter is None else meter.track(tensor)


def free(meter: ScratchMeter | None, tensor: torch.Tensor | None) -> None:
    if meter is not None and tensor is not None:
        meter.free(tensor)
