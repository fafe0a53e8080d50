"""Whether a step may change anything, agreed on the device: no host collective, no host read.

The step's collectives are the plan's, the same on every rank whatever its grads: a rank
with a missing or unusable grad still sends a block (its momentum, unchanged). What the
ranks must agree on travels in **one** small device ``all_reduce`` per ``DMuon`` and
step, over the union of the ranks of its DTensor parameters (Muon and AdamW alike), the
step's *status*, before anything is written:

- per DTensor parameter: how many ranks have a usable grad, how many have none, and how
  many hold it as a ``Partial`` sum (``dmuon.exchange.replicated_grads``: all of them or
  none may);
- how many ranks found a problem of their own (an invalid grad, a shard unlike the plan).

The ``all_reduce`` is asynchronous: :class:`StatusMasks` waits for it at the first mask
read, so the host work before that overlaps its latency.

From the sums every rank computes the same masks on the device
(``dmuon.numerics.masked_updates``): the step's mask, False on every rank when any rank
found a problem or a DTensor parameter has a grad on some ranks but not on others (the
whole step then changes nothing, on any rank, plain parameters included); and each DTensor
parameter's mask, the step's and "some rank has its grad" (a parameter without a grad
anywhere is skipped, as ``torch.optim`` skips it).

Errors, the same on every rank. A rank that found a problem of its own raises its
message at the end of that step, after the collectives every rank runs. The sums are
copied to the host without waiting (pinned memory, non-blocking) and read at the next
``step()`` (:meth:`GradStatus.take_pending`): if they show a problem, that step runs
masked on every rank (the same collectives, nothing written) and every rank raises the
same error at its end. So every rank raises at the latest at the next step, and none
waits in a collective the others skipped.

Plain (non-DTensor) parameters are per-process, as in ``torch.optim``: they take no part
in the sums, but the step's mask covers them too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dmuon.exchange.comm import mesh_device
from dmuon.exchange.groups import group_of
from dmuon.exchange.host_copy import HostCopy, to_device
from dmuon.exchange.replicated_grads import partial_grad, replicated, sum_replicated_grads
from dmuon.plan.mesh_facts import mesh_ranks

STATUS_DTYPE = torch.int32
BLOCKS = 4
"""The status's blocks of one entry per parameter (ranks with a grad, without one, a
disagreement counted over a strict subset of the ranks, ``Partial`` grads), then the
count of ranks with a problem."""


def distributed(param: torch.Tensor) -> bool:
    """Whether a parameter's step may involve other ranks: a DTensor (on a mesh of one
    rank too, so that every DTensor takes the one masked step)."""
    return isinstance(param, DTensor)


@dataclass
class RankSet:
    """DTensor parameters on meshes of a strict subset of the union's ranks (a row of a
    grid, a stage's mesh inside a larger DMuon): the same index may be another parameter on
    another subset, so their grads are counted over their own ranks first."""

    positions: list[int]
    """Where they stand among the channel's parameters."""
    group: dist.ProcessGroup | None
    _index: torch.Tensor | None = None

    def index(self, device: torch.device) -> torch.Tensor:
        """``positions`` on the device, made once."""
        if self._index is None:
            self._index = to_device(self.positions, device, torch.int64)
        return self._index


@dataclass
class StatusChannel:
    """The DTensor parameters of one ``DMuon`` and where their status is summed: the union
    of their meshes' ranks (one reduction, so one rank's problem masks all of them)."""

    params: list[DTensor]
    names: list[str]
    """The parameters' names, for the error of a later step."""
    group: dist.ProcessGroup | None
    """None where the union is this rank alone: the sums are this rank's own."""
    device: torch.device
    subsets: list[RankSet]
    """Parameters on strict subsets of the union, by rank set (usually none)."""
    replicated: list[DTensor]
    """Parameters replicated on every dim of their mesh, whose grads every rank sums at
    every step (``dmuon.exchange.replicated_grads``)."""

    def union_positions(self) -> list[int]:
        inside = {j for subset in self.subsets for j in subset.positions}
        return [j for j in range(len(self.params)) if j not in inside]


def status_channel(params: Sequence[torch.Tensor], name_of: Callable[[torch.Tensor], str]) -> StatusChannel | None:
    """The channel of every DTensor among ``params`` (None without any). Made once, at
    planning: a group no mesh provides is made here, never in a steady step."""
    dtensors = [p for p in params if distributed(p)]
    if not dtensors:
        return None
    meshes = list({id(p.device_mesh): p.device_mesh for p in dtensors}.values())
    ranks = tuple(sorted({r for mesh in meshes for r in mesh_ranks(mesh)}))
    group = group_of(ranks, meshes) if len(ranks) > 1 else None
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for j, param in enumerate(dtensors):
        own = mesh_ranks(param.device_mesh)
        if own != ranks:
            by_ranks.setdefault(own, []).append(j)
    subsets = [RankSet(positions, group_of(own, [dtensors[positions[0]].device_mesh]) if len(own) > 1 else None)
               for own, positions in by_ranks.items()]
    return StatusChannel(dtensors, [name_of(p) for p in dtensors], group, mesh_device(meshes[0]), subsets,
                         [p for p in dtensors if replicated(p)])


class StatusMasks(Mapping[torch.Tensor, torch.Tensor]):
    """The step's mask and each DTensor parameter's (0-dim bools on the device), once the
    step's status sums arrive. The sums are started by :meth:`GradStatus.agree` and waited
    for at the first mask read (or :meth:`finish`), so the host work in between (the
    Muon part's bookkeeping) overlaps the collective's latency; membership needs no wait.

    ``host_ok``: the step's mask as the host knows it without waiting: False where this
    rank knows the step is masked (its own problem, or an error pending from the last
    step), True where no other rank takes part (no sums to wait for) and nothing is
    wrong here, None where only the device knows."""

    def __init__(self, channel: StatusChannel | None, status: torch.Tensor | None, work: Any,
                 subset_sums: list[torch.Tensor], host_ok: bool | None, masked_here: bool,
                 device: torch.device | None, pending: list[tuple[list[str], HostCopy]]) -> None:
        self._channel, self._status, self._work, self._subset_sums = channel, status, work, subset_sums
        self.host_ok = host_ok
        self._masked_here = masked_here
        self._device = device
        self._pending = pending
        self._keys = {} if channel is None else {p: None for p in channel.params}
        self._oks: dict[torch.Tensor, torch.Tensor] | None = None
        self._step_ok: torch.Tensor | None = None

    def finish(self) -> dict[torch.Tensor, torch.Tensor]:
        """Wait for the sums (on the device: no host read), make the masks, and send the sums
        to the host for the next step's :meth:`GradStatus.take_pending`; once."""
        if self._oks is not None:
            return self._oks
        self._oks = {}
        if self._channel is None:
            self._step_ok = torch.full((), bool(self.host_ok), dtype=torch.bool, device=self._device)
            return self._oks
        if self._work is not None:
            self._work.wait()
        status, n = self._status, len(self._channel.params)
        has, has_not, uneven_elsewhere, partial = (status[k * n : (k + 1) * n] for k in range(BLOCKS))
        # Counting the ranks with and without a grad (rather than comparing one count with
        # the group's size) gives the right answer on a group whose sums are local too.
        uneven = ((has > 0) & (has_not > 0)) | (uneven_elsewhere > 0) | ((partial > 0) & (partial < has))
        step_ok = (status[BLOCKS * n] == 0) & ~uneven.any()
        if self._masked_here:  # this rank's problem, or an error pending from the last step
            step_ok = torch.zeros((), dtype=torch.bool, device=status.device)
        self._step_ok = step_ok
        present = has > 0
        for subset, sums in zip(self._channel.subsets, self._subset_sums):  # counted over their own ranks
            present = present.index_copy(0, subset.index(status.device), sums[: len(subset.positions)] > 0)
        self._oks.update(zip(self._channel.params, (present & step_ok).unbind()))
        self._pending.append((self._channel.names, HostCopy(status)))
        return self._oks

    def mask_here(self) -> None:
        """Mask this step where the host knew it stood (``host_ok`` True: no other rank takes
        part), e.g. after torch's AdamW raised; before any mask is read."""
        assert self.host_ok and self._oks is None, "only a step no other rank takes part in is masked here"
        self.host_ok, self._masked_here = False, True

    @property
    def step_ok(self) -> torch.Tensor:
        """The step's mask: False on every rank when any rank may not step (0-dim bool)."""
        self.finish()
        return self._step_ok

    def __getitem__(self, param: torch.Tensor) -> torch.Tensor:
        return (self._oks if self._oks is not None else self.finish())[param]  # read per parameter: no call once made

    def __contains__(self, param: object) -> bool:
        return param in self._keys

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class GradStatus:
    """One optimizer's status channel: :meth:`take_pending` and :meth:`agree` each step."""

    def __init__(self) -> None:
        self._pending: list[tuple[list[str], HostCopy]] = []
        self._channel: StatusChannel | None = None
        self._planned = False

    def plan(self, params: Sequence[torch.Tensor], name_of: Callable[[torch.Tensor], str]) -> None:
        """Make the channel of ``params`` (every parameter of the optimizer), once."""
        if not self._planned:
            self._channel = status_channel(params, name_of)
            self._planned = True

    def agree(self, has_grad: Callable[[torch.Tensor], bool], problem_here: bool, masked_here: bool,
              device: torch.device) -> StatusMasks:
        """Start summing every rank's status (one device ``all_reduce`` over the union,
        asynchronous; before it, one per rank set of parameters on a strict subset of it,
        whose disagreements it carries) and return the masks that read the sums
        (:class:`StatusMasks`). ``masked_here``: every rank knows this step is masked (an
        error pending from the last step)."""
        channel = self._channel
        if channel is None:
            return StatusMasks(None, None, None, [], not (problem_here or masked_here), masked_here, device,
                               self._pending)
        has = [int(has_grad(p)) for p in channel.params]
        partial = [int(h and partial_grad(p.grad)) for h, p in zip(has, channel.params)]
        n = len(has)
        outside = n * [1]
        for subset in channel.subsets:
            for j in subset.positions:
                outside[j] = 0
        status = to_device([*(h * o for h, o in zip(has, outside)), *((1 - h) * o for h, o in zip(has, outside)),
                            *n * [0], *(q * o for q, o in zip(partial, outside)), int(problem_here)],
                           channel.device, STATUS_DTYPE)
        subset_sums = []
        for subset in channel.subsets:
            sums = to_device([*(has[j] for j in subset.positions), *(1 - has[j] for j in subset.positions),
                              *(partial[j] for j in subset.positions)], channel.device, STATUS_DTYPE)
            if subset.group is not None:
                dist.all_reduce(sums, group=subset.group)  # waited for on the device: no host read
            m = len(subset.positions)
            some, none, partials = sums[:m], sums[m : 2 * m], sums[2 * m :]
            disagree = ((some > 0) & (none > 0)) | ((partials > 0) & (partials < some))
            status[2 * n : 3 * n].index_copy_(0, subset.index(channel.device), disagree.to(STATUS_DTYPE))
            subset_sums.append(sums)
        work = None if channel.group is None else dist.all_reduce(status, group=channel.group, async_op=True)
        host_ok: bool | None = None
        if problem_here or masked_here:
            host_ok = False
        elif channel.group is None:
            host_ok = True
        return StatusMasks(channel, status, work, subset_sums, host_ok, masked_here or problem_here, channel.device,
                           self._pending)

    def take_pending(self) -> Exception | None:
        """The previous step's problem as the error every rank raises alike (None if its
        status showed none). A sum not yet readable (a CUDA graph being captured) waits."""
        pending, self._pending = self._pending, []
        problems = 0
        uneven: list[str] = []
        mixed: list[str] = []
        for names, copy in pending:
            if copy.deferred():  # a CUDA graph is being captured: read it at a later step
                self._pending.append((names, copy))
                continue
            sums = copy.read()
            if sums is None:  # a fake run's: no values
                continue
            n = len(names)
            problems = max(problems, sums[BLOCKS * n])
            uneven += [name for name, yes, no, elsewhere in zip(names, sums[:n], sums[n : 2 * n], sums[2 * n : 3 * n])
                       if (yes and no) or elsewhere]
            mixed += [name for name, yes, part in zip(names, sums[:n], sums[3 * n : 4 * n]) if 0 < part < yes]
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
                "but not on others (or a Partial one on some ranks only) in the previous step, which changed no parameter or state on any rank. Every "
                "rank must produce the same set of grads (set unused grads to zeros, or to None on every rank).")
        return None

    def sum_replicated(self, usable: Callable[[torch.Tensor], bool]) -> dict[torch.Tensor, torch.Tensor]:
        """The replicated parameters' grads, summed by every rank alike (``usable``: whether
        this rank's grad passed the local checks), after :meth:`agree`."""
        return {} if self._channel is None else sum_replicated_grads(self._channel.replicated, usable)

    def forget(self) -> None:
        """Drop the channel (the parameters changed); made again at the next step."""
        self._channel, self._planned = None, False


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
