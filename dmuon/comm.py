"""Move the blocks of an :class:`~dmuon.plan.OwnerPlan` with collectives.

One batch is two ``all_to_all_single`` calls on flat bf16 buffers:

- *gather*: every source rank sends its block of each travelling unit to the unit's
  owner, and the owner copies each block to its place in the whole matrix (the same
  bf16 values a single process would hold);
- *scatter*: each owner sends every holder (every replica) its block of the
  orthogonalized matrix.

Packing and unpacking are plain tensor code, separate from the collective, so they
can be tested by routing buffers between simulated ranks in one process (also on the
``meta`` device). Every buffer is created on the device the caller names, which is
the mesh's device: NCCL rejects a CPU tensor where gloo would quietly accept it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon.newton_schulz import UPDATE_DTYPE as WIRE_DTYPE
from dmuon.plan import Block, OwnerPlan


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
    """Live and peak bytes of the scratch tensors the step's schedule holds.

    The step calls ``track(t)`` when it makes a scratch tensor and ``free(t)`` where the
    schedule lets go of it, so ``peak_bytes`` is exactly what the plan's
    ``peak_scratch_bytes`` predicts. (Counting Python object lifetimes instead would be
    racy: gloo's and NCCL's workers release a finished collective's tensors a moment
    after ``wait()`` returns.)
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


def gather_send_order(plan: OwnerPlan, batch: Sequence[int], rank: int) -> list[int]:
    """Units whose block ``rank`` sends, in send-buffer order: by owner, then batch order."""
    return _by_owner(plan, [i for i in plan.travelling(batch) if plan.units[i].is_source(rank)])


def scatter_receive_order(plan: OwnerPlan, batch: Sequence[int], rank: int) -> list[int]:
    """Units whose result block ``rank`` receives, in receive-buffer order: by owner,
    then batch order."""
    return _by_owner(plan, [i for i in plan.travelling(batch) if plan.units[i].block(rank)])


def _by_owner(plan: OwnerPlan, units: list[int]) -> list[int]:
    return sorted(units, key=lambda i: plan.units[i].owner)  # stable: batch order within an owner


def pack_gather(
    plan: OwnerPlan,
    batch: Sequence[int],
    rank: int,
    block_of: Callable[[int], torch.Tensor],
    device: torch.device,
    meter: ScratchMeter | None = None,
) -> torch.Tensor:
    """The gather's send buffer. ``block_of(unit)`` makes this rank's bf16 block of a
    unit (running its momentum); it is called for every travelling unit the rank
    holds, also those another replica sends, so every replica's momentum stays
    current. Blocks are made one at a time and copied in, so only one lives at once."""
    send = _track(meter, torch.empty(sum(plan.gather_splits(batch, rank)[0]), dtype=WIRE_DTYPE, device=device))
    offsets, offset = {}, 0
    for i in gather_send_order(plan, batch, rank):
        offsets[i] = offset
        offset += plan.units[i].block_numel(rank)
    for i in plan.travelling(batch):
        if not plan.units[i].block(rank):
            continue
        block = block_of(i)
        if i in offsets:
            send[offsets[i] : offsets[i] + block.numel()].copy_(block.reshape(-1))
        _free(meter, block)
    return send


def unpack_gather(
    plan: OwnerPlan, batch: Sequence[int], rank: int, recv: torch.Tensor, meter: ScratchMeter | None = None
) -> dict[int, torch.Tensor]:
    """Whole matrices of the travelling units ``rank`` owns, from the gather's receive
    buffer (by source rank, then batch order), each a new tensor: every source's block
    copied to its place."""
    owned = [i for i in plan.travelling(batch) if plan.units[i].owner == rank]
    full = {i: _track(meter, recv.new_empty(plan.units[i].matrix)) for i in owned}
    offset = 0
    for source in range(plan.world_size):
        for i in owned:
            unit = plan.units[i]
            if unit.is_source(source):
                block = unit.block(source)
                _region(full[i], block).copy_(recv[offset : offset + block.numel].view(block.shape))
                offset += block.numel
    return full


def pack_scatter(
    plan: OwnerPlan,
    batch: Sequence[int],
    rank: int,
    results: Mapping[int, torch.Tensor],
    device: torch.device,
    meter: ScratchMeter | None = None,
) -> torch.Tensor:
    """The scatter's send buffer: by holder rank, then batch order, that rank's block
    of each result this rank owns."""
    owned = [i for i in plan.travelling(batch) if plan.units[i].owner == rank]
    send = _track(meter, torch.empty(sum(plan.scatter_splits(batch, rank)[0]), dtype=WIRE_DTYPE, device=device))
    offset = 0
    for dest in range(plan.world_size):
        for i in owned:
            block = plan.units[i].block(dest)
            if block:
                send[offset : offset + block.numel].view(block.shape).copy_(_region(results[i], block))
                offset += block.numel
    return send


def unpack_scatter(plan: OwnerPlan, batch: Sequence[int], rank: int, recv: torch.Tensor) -> dict[int, torch.Tensor]:
    """``rank``'s block (a view of ``recv``) of every travelling unit it holds."""
    local: dict[int, torch.Tensor] = {}
    offset = 0
    for i in scatter_receive_order(plan, batch, rank):
        block = plan.units[i].block(rank)
        local[i] = recv[offset : offset + block.numel].view(block.shape)
        offset += block.numel
    return local


def _region(matrix: torch.Tensor, block: Block) -> torch.Tensor:
    """The view of a unit's whole matrix that ``block`` covers."""
    (row, col), (rows, cols) = block.offset, block.shape
    return matrix[row : row + rows, col : col + cols]


class Exchange:
    """An ``all_to_all_single`` in flight: ``wait()`` hands over the receive buffer.

    Both buffers must be on the mesh's device type; the check runs before the
    collective, so a wrong device fails here, with a message, on every backend.
    """

    def __init__(
        self,
        send: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup,
        group_rank: int,
        stats: CommStats,
        device: torch.device,
        meter: ScratchMeter | None = None,
    ) -> None:
        self.send_splits, self.recv_splits = send_splits, recv_splits
        recv = _track(meter, torch.empty(sum(recv_splits), dtype=WIRE_DTYPE, device=device))
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
        _free(self._meter, self._send)
        self._send = None
        recv, self._recv = self._recv, None
        if recv is None:
            raise RuntimeError("Exchange.wait() was called twice")
        return recv


def _track(meter: ScratchMeter | None, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if meter is None else meter.track(tensor)


def _free(meter: ScratchMeter | None, tensor: torch.Tensor | None) -> None:
    if meter is not None and tensor is not None:
        meter.free(tensor)
