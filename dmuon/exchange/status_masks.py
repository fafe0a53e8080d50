"""The masks a step reads from its status sums (``dmuon.exchange.grad_status`` starts the
sums; this is what the step's rules read of them): the step's mask and each DTensor
parameter's, 0-dim bools on the device, never read on the host in the step.

A parameter's mask is the step's mask itself where this rank has its grad, and a False
tensor where it has none. That is "the step's, and some rank has the grad": where the
step's mask holds, every rank of a parameter has its grad or none has (a disagreement
masks the step), so this rank's own answer is every rank's. So a step has at most two
distinct masks, and the rules run one list op per mask (``dmuon.numerics.masked_updates``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from dmuon.exchange.host_copy import HostCopy
from dmuon.exchange.status_channel import StatusChannel

STATUS_DTYPE = torch.int32
BLOCKS = 4
"""The status's blocks of one entry per parameter (ranks with a grad, without one, a
disagreement counted over a strict subset of the ranks, ``Partial`` grads), then two
counts: ranks with a problem, ranks with a non-finite grad (``skip_nonfinite``)."""
NOT_WAITED = "a mask was read before the step's wait (dmuon.step.phases: phase 3 comes before any mask read)"


class StepMask(enum.Enum):
    """What the host knows of the step's mask without waiting for the device."""

    STANDS = "stands"
    """The step applies: no other rank takes part, nothing is wrong here, nothing to check
    on the device."""
    MASKED = "masked"
    """Nothing changes: this rank's own problem, or an error pending from the last step."""
    ON_DEVICE = "on_device"
    """Only the device knows (the ranks' sums, or ``skip_nonfinite``'s check): the rules
    read the masks."""


def _disagreement(status: torch.Tensor, n: int) -> torch.Tensor:
    """Whether the ranks disagree on some parameter's grad (0-dim device bool). Counting the
    ranks with and without a grad (not one count against the group's size) is also right
    on a group whose sums are local."""
    if n == 0:
        return torch.zeros((), dtype=torch.bool, device=status.device)
    has, has_not, uneven_elsewhere, partial = (status[k * n : (k + 1) * n] for k in range(BLOCKS))
    return (((has > 0) & (has_not > 0)) | (uneven_elsewhere > 0) | ((partial > 0) & (partial < has))).any()


class StatusMasks(Mapping[torch.Tensor, torch.Tensor]):
    """The step's mask and each DTensor parameter's, made by :meth:`wait`, the step's one
    wait (its phase 3); a mask read before it raises. Membership needs no wait. ``mask``:
    the step's mask as the host knows it without waiting (:class:`StepMask`)."""

    def __init__(self, channel: StatusChannel | None, status: torch.Tensor | None, work: Any,
                 has: list[int], mask: StepMask, masked_here: bool,
                 device: torch.device | None, pending: list[tuple[list[str], HostCopy]],
                 tally: ReplayTally | None = None, finite: torch.Tensor | None = None) -> None:
        self._channel, self._status, self._work, self._has = channel, status, work, has  # has: this rank's grads
        self._finite = finite  # this rank's grads finite, where no other rank takes part (skip_nonfinite)
        self.mask = mask
        self._masked_here = masked_here
        self._device = device
        self._pending = pending
        self._tally = tally  # while a CUDA graph is captured: counts each replay's status (dmuon.capture.cuda_graphs)
        self._keys = {} if channel is None else {p: None for p in channel.params}
        self._oks: dict[torch.Tensor, torch.Tensor] | None = None
        self._step_ok: torch.Tensor | None = None

    def wait(self) -> dict[torch.Tensor, torch.Tensor]:
        """Wait for the sums (on an accelerator a stream wait, no host read), make the masks,
        and send the sums to the host for the next step's :meth:`GradStatus.take_pending`; once."""
        if self._oks is not None:
            return self._oks
        self._oks = {}
        if self._channel is None:
            self._step_ok = torch.full((), self.mask is not StepMask.MASKED, dtype=torch.bool, device=self._device)
            if self._finite is not None and self.mask is not StepMask.MASKED:  # a step that raises is no skip
                self._step_ok = self._step_ok & self._finite
                counts = torch.zeros(2, dtype=STATUS_DTYPE, device=self._finite.device)
                counts[1].copy_(~self._finite)  # [problems, non-finite], as a channel's tail
                self._send_to_host([], counts)
            return self._oks
        if self._work is not None:
            self._work.wait()
        status, n = self._status, len(self._channel.params)
        step_ok = (status[BLOCKS * n] == 0) & (status[BLOCKS * n + 1] == 0) & ~_disagreement(status, n)
        if self._masked_here:  # this rank's problem, or an error pending from the last step
            step_ok = torch.zeros((), dtype=torch.bool, device=status.device)
        self._step_ok = step_ok
        never = torch.zeros((), dtype=torch.bool, device=status.device) if not all(self._has) else None
        self._oks.update((p, step_ok if h else never) for p, h in zip(self._channel.params, self._has))
        self._send_to_host(self._channel.names, status)
        return self._oks

    def _send_to_host(self, names: list[str], status: torch.Tensor) -> None:
        """Queue the summed ``status`` for the next step's read (and count it in the tally of
        a graph being captured, whose replays the host does not read one by one)."""
        self._pending.append((names, HostCopy(status)))
        if self._tally is not None:
            self._tally.add_(status)

    def mask_here(self) -> None:
        """Mask the rest of this step where no other rank takes part, e.g. after torch's
        AdamW raised (with ``skip_nonfinite`` the mask may already be made: it turns False)."""
        assert self.alone, "only a step no other rank takes part in is masked here"
        self.mask, self._masked_here = StepMask.MASKED, True
        if self._step_ok is not None:  # the masks are made already: every one turns False
            self._step_ok = torch.zeros_like(self._step_ok)
            self._oks = {param: self._step_ok for param in self._oks or {}}

    @property
    def alone(self) -> bool:
        """Whether no other rank takes part in this step's status."""
        return self._channel is None or self._channel.group is None

    @property
    def step_ok(self) -> torch.Tensor:
        """The step's mask: False on every rank when any rank may not step (0-dim bool)."""
        if self._step_ok is None:
            raise RuntimeError(NOT_WAITED)
        return self._step_ok

    def __getitem__(self, param: torch.Tensor) -> torch.Tensor:
        if self._oks is None:
            raise RuntimeError(NOT_WAITED)
        return self._oks[param]

    def __contains__(self, param: object) -> bool:
        return param in self._keys

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ReplayTally:
    """What the replays of a captured step found, counted on the device
    (``dmuon.capture.cuda_graphs``).

    A replayed graph runs no host code and copies into the same pinned memory each time, so
    a host reader would see the last replay only. Each replay adds to a tally instead
    whether its step was skipped (a non-finite grad, nothing else wrong) and whether it
    found an error, and keeps the status of the first replay with an error; the reader
    takes the counts and resets them. Its tensors are made and zeroed before the capture:
    zeroed inside it, the zeroing would run at every replay."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = names  # the status's parameters (BLOCKS entries each, then the two counts)
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # [skipped, with an error]
        self.first_error = torch.zeros(BLOCKS * len(names) + 2, dtype=STATUS_DTYPE, device=device)

    def add_(self, status: torch.Tensor) -> None:
        """Count one step's summed ``status`` (device ops only: recorded into the graph)."""
        n = len(self.names)
        error = (status[BLOCKS * n] > 0) | _disagreement(status, n)
        skipped = (status[BLOCKS * n + 1] > 0) & ~error
        self.first_error.copy_(torch.where(error & (self.counts[1] == 0), status, self.first_error))
        self.counts.add_(torch.stack([skipped, error]).to(self.counts.dtype))

    def take(self) -> tuple[int, int, list[int]]:
        """(skipped steps, steps with an error, the first such step's status) since the last
        take, read on the host (a wait: call it after the replays were waited for); then reset."""
        skipped, errors = self.counts.tolist()
        first = self.first_error.tolist()
        self.counts.zero_()
        return skipped, errors, first
