"""Whether a step may change anything, agreed on the device: no host collective, no host read.

The step's collectives are the plan's, the same on every rank whatever its grads: a rank
with a missing or unusable grad still sends a block (its momentum, unchanged). What the
ranks must agree on travels in **one** small device ``all_reduce`` per ``DMuon`` and step,
over the union of the ranks of its DTensor parameters (Muon and AdamW alike), before
anything is written: per DTensor parameter, how many ranks have a usable grad, none, or a
``Partial`` one (``dmuon.exchange.replicated_grads``: all of them or none may); how many
ranks found a problem of their own; with ``skip_nonfinite``, how many hold a NaN or inf
(``dmuon.numerics.finite``: the step is skipped on every rank, no error). It is
asynchronous: :meth:`StatusMasks.wait` (phase 3 of ``dmuon.step.phases``) waits for it, on
an accelerator a stream wait, so the host goes on enqueueing while the sums travel. The
masks read from the sums: ``dmuon.exchange.status_masks``.

Errors, the same on every rank. A rank's own problem is raised at the end of that step,
after the collectives every rank runs. The sums go to the host without waiting (pinned
memory, non-blocking) and are read at the next ``step()`` (:meth:`GradStatus.take_pending`):
if they show a problem, that step runs masked on every rank (the same collectives, nothing
written) and every rank raises the same error at its end, so none waits in a collective
the others skipped. Plain (non-DTensor) parameters take no part in the sums (per-process,
as in ``torch.optim``), but the step's mask covers them too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dmuon.exchange.host_copy import HostCopy, to_device
from dmuon.exchange.replicated_grads import partial_grad, sum_replicated_grads
from dmuon.exchange.status_channel import StatusChannel, status_channel
from dmuon.exchange.status_masks import BLOCKS, STATUS_DTYPE, ReplayTally, StatusMasks, StepMask

class GradStatus:
    """One optimizer's status channel: :meth:`take_pending` and :meth:`agree` each step."""

    def __init__(self) -> None:
        self._pending: list[tuple[list[str], HostCopy]] = []
        self.skipped_steps = 0
        """Steps skipped for a non-finite grad (``skip_nonfinite``), as counted when the next
        step reads their status (so one step late, without a sync)."""
        self.last_masked = False
        """Whether the status read by the last :meth:`take_pending` showed a masked step."""
        self._held: Exception | None = None  # an error :meth:`settle` read, for the next step to raise
        self._channel: StatusChannel | None = None
        self._planned = False
        self._tally: ReplayTally | None = None  # while a CUDA graph is captured: its replays' counts

    def plan(self, params: Sequence[torch.Tensor], name_of: Callable[[torch.Tensor], str]) -> None:
        """Make the channel of ``params`` (every parameter of the optimizer), once."""
        if not self._planned:
            self._channel = status_channel(params, name_of)
            self._planned = True

    def agree(self, has_grad: Callable[[torch.Tensor], bool], problem_here: bool, masked_here: bool,
              device: torch.device, finite: torch.Tensor | None = None) -> StatusMasks:
        """Start summing every rank's status (one asynchronous device ``all_reduce`` over the
        union; before it, one per strict subset, whose disagreements it carries) and return
        the masks that read the sums. ``masked_here``: an error is pending from the last step.
        ``finite``: whether this rank's grads are finite (0-dim device bool), or None."""
        channel = self._channel
        mask = StepMask.ON_DEVICE
        if problem_here or masked_here:
            mask = StepMask.MASKED
        elif (channel is None or channel.group is None) and finite is None:
            mask = StepMask.STANDS
        if channel is None:
            return StatusMasks(None, None, None, [], mask, masked_here, device, self._pending, self._tally, finite)
        has = [int(has_grad(p)) for p in channel.params]
        partial = [int(h and partial_grad(p.grad)) for h, p in zip(has, channel.params)]
        n = len(has)
        inside = {j for subset in channel.subsets for j in subset.positions}
        outside = [int(j not in inside) for j in range(n)]
        status = to_device([*(h * o for h, o in zip(has, outside)), *((1 - h) * o for h, o in zip(has, outside)),
                            *n * [0], *(q * o for q, o in zip(partial, outside)), int(problem_here), 0],
                           channel.device, STATUS_DTYPE)
        if finite is not None:
            status[BLOCKS * n + 1].copy_(~finite)
        for subset in channel.subsets:
            sums = to_device([*(has[j] for j in subset.positions), *(1 - has[j] for j in subset.positions),
                              *(partial[j] for j in subset.positions)], channel.device, STATUS_DTYPE)
            if subset.group is not None:
                dist.all_reduce(sums, group=subset.group)  # waited for on the device: no host read
            m = len(subset.positions)
            some, none, partials = sums[:m], sums[m : 2 * m], sums[2 * m :]
            disagree = ((some > 0) & (none > 0)) | ((partials > 0) & (partials < some))
            status[2 * n : 3 * n].index_copy_(0, subset.index(channel.device), disagree.to(STATUS_DTYPE))
        work = None if channel.group is None else dist.all_reduce(status, group=channel.group, async_op=True)
        return StatusMasks(channel, status, work, has, mask, masked_here or problem_here, channel.device,
                           self._pending, self._tally)

    @property
    def channel(self) -> StatusChannel | None:
        """The status channel, once planned (None before, or without DTensor parameters)."""
        return self._channel

    @property
    def device(self) -> torch.device | None:
        """Where the status is summed (the meshes' device; None without a channel)."""
        return None if self._channel is None else self._channel.device

    def start_tally(self, device: torch.device) -> None:
        """Count the status of every step recorded from now on in a :class:`ReplayTally` (a CUDA
        graph's capture: ``dmuon.capture.cuda_graphs``); made and zeroed now, before the capture."""
        names = [] if self._channel is None else self._channel.names
        self._tally = ReplayTally(names, self.device or device)

    def end_tally(self) -> ReplayTally:
        """The tally :meth:`start_tally` began (each replay of the graph adds to it); the
        status copies the capture queued are dropped: the tally counts those steps."""
        tally, self._tally = self._tally, None
        assert tally is not None, "end_tally without start_tally"
        self._pending = [(names, copy) for names, copy in self._pending if not copy.in_graph]
        return tally

    def count_replays(self, tally: ReplayTally) -> Exception | None:
        """Count the skipped steps of the replays since the last call (after a wait for them)
        and return the error of the first replay that found one (None if none did)."""
        skipped, errors, first = tally.take()
        self.skipped_steps += skipped
        if not errors:
            return None
        problems, _, uneven, mixed = _read_sums(tally.names, first)
        return _status_error(problems, mixed, uneven)

    def holds_error(self) -> bool:
        """Whether :meth:`settle` read an error the next step raises."""
        return self._held is not None

    def take_held(self) -> Exception | None:
        """The error :meth:`settle` read early and holds for the next step, taken (a captured
        step's reader raises it itself: ``dmuon.capture.cuda_graphs``)."""
        held, self._held = self._held, None
        return held

    def settle(self) -> bool:
        """Read the last step's status now, ahead of the next step (a wait for the device:
        for ``state_dict``, never inside ``step()``): whether that step was masked. Its
        error, if any, is still raised by the next step."""
        self._held = self.take_pending() or self._held
        return self.last_masked

    def take_pending(self) -> Exception | None:
        """The previous step's problem as the error every rank raises alike (None if its
        status showed none). A sum not yet readable (a CUDA graph being captured) waits."""
        held, self._held = self._held, None
        if held is not None:  # read early by settle(), whose caller took the step's host changes back
            self.take_pending()
            self.last_masked = True
            return held
        pending, self._pending = self._pending, []
        problems = nonfinite = 0
        uneven: list[str] = []
        mixed: list[str] = []
        for names, copy in pending:
            if copy.deferred():  # a CUDA graph is being captured: read it at a later step
                self._pending.append((names, copy))
                continue
            sums = copy.read()
            if sums is None:  # a fake run's: no values
                continue
            its_problems, its_nonfinite, its_uneven, its_mixed = _read_sums(names, sums)
            problems = max(problems, its_problems)
            nonfinite += its_nonfinite
            uneven += its_uneven
            mixed += its_mixed
        self.last_masked = bool(problems or mixed or uneven or nonfinite)
        if not (problems or mixed or uneven):
            self.skipped_steps += nonfinite  # a non-finite grad somewhere: skipped everywhere, no error
        return _status_error(problems, mixed, uneven)

    def sum_replicated(self, usable: Callable[[torch.Tensor], bool]) -> dict[torch.Tensor, torch.Tensor]:
        """The replicated parameters' grads, summed by every rank alike (``usable``: whether
        this rank's grad passed the local checks), after :meth:`agree`."""
        return {} if self._channel is None else sum_replicated_grads(self._channel.replicated, usable)

    def forget(self) -> None:
        """Drop the channel (the parameters changed); made again at the next step."""
        self._channel, self._planned = None, False


def _read_sums(names: list[str], sums: list[int]) -> tuple[int, bool, list[str], list[str]]:
    """One status's sums read on the host: ranks with a problem, whether a grad was
    non-finite, the parameters whose grads the ranks disagree on, those ``Partial`` on some only."""
    n = len(names)
    uneven = [name for name, yes, no, elsewhere in zip(names, sums[:n], sums[n : 2 * n], sums[2 * n : 3 * n])
              if (yes and no) or elsewhere]
    mixed = [name for name, yes, part in zip(names, sums[:n], sums[3 * n : 4 * n]) if 0 < part < yes]
    return sums[BLOCKS * n], bool(sums[BLOCKS * n + 1]), uneven, mixed


def _status_error(problems: int, mixed: list[str], uneven: list[str]) -> Exception | None:
    """The error every rank raises alike for what a status showed (None: nothing wrong)."""
    if problems:
        return ValueError(
            f"DMuon: {problems} rank(s) found an invalid gradient or shard in the previous step; see their "
            "error message. That step changed no parameter or state on any rank.")
    if mixed:
        return RuntimeError(
            f"DMuon: ranks disagree on how gradients are placed: {mixed} was a Partial sum on some ranks and "
            "replicated on others in the previous step, which changed no parameter or state on any rank. "
            "Every rank of a parameter's mesh must give its grad the same placements.")
    if uneven:
        return RuntimeError(
            f"DMuon: ranks disagree on which parameters have gradients: {uneven} had a grad on some ranks "
            "but not on others (or a Partial one on some ranks only) in the previous step, which changed no "
            "parameter or state on any rank. Every rank must produce the same set of grads (set unused grads to "
            "zeros, or to None on every rank).")
    return None


def usable_grad(param: torch.Tensor, summed: Mapping[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``param.grad`` laid out like ``param``: a replicated parameter's as every rank summed it
    (``summed``, :meth:`GradStatus.sum_replicated`); a replicated grad of a sharded parameter
    cut to this rank's block (local: no collective)."""
    if param in summed:
        return summed[param]
    grad = param.grad
    if isinstance(param, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)  # Replicate -> Shard: a local cut
    return grad
