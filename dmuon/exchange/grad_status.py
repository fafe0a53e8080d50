"""Which grads a step may apply, agreed on the device: no host collective, no host read.

The step's collectives are the plan's, the same on every rank whatever its grads: a rank
with a missing or unusable grad still sends a block (its momentum, unchanged). What the
ranks must agree on travels in one small device ``all_reduce`` per rank set, the step's
*status*, before anything is written:

- per distributed Muon parameter: how many ranks have a usable grad, how many have none;
- how many ranks found a problem of their own (an invalid grad, a shard unlike the plan).

The ``all_reduce`` is asynchronous: :class:`StatusMasks` waits for it at the first mask
read, so the host work before that overlaps its latency.

From the sums every rank computes the same mask on the device: a parameter is applied
where every rank has its grad and no rank found a problem
(``dmuon.numerics.masked_updates``). A parameter without a grad anywhere is skipped as
``torch.optim`` skips it; one with a grad on some ranks only is applied nowhere; any
rank's problem leaves every distributed Muon parameter and its state as they were.

Errors, the same on every rank. A rank that found a problem of its own raises its
message at the end of that step, after the collectives every rank runs. The sums are
copied to the host without waiting (pinned memory, non-blocking) and read at the next
``step()``: if they show a problem, every rank raises the same error there, before the
step touches anything. So every rank raises at the latest at the next step, and none
waits in a collective the others skipped.
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
from dmuon.plan.mesh_facts import mesh_ranks
from dmuon.torch_compat import local_of

STATUS_DTYPE = torch.int32


def grad_problem(param: torch.Tensor, use_muon: bool) -> str | None:
    """Why ``param.grad`` cannot be used, or None."""
    grad = param.grad
    if grad.is_sparse or local_of(grad).is_sparse:  # a DTensor says strided whatever its local tensor
        return "sparse gradients are not supported"
    if not use_muon:
        return None
    if grad.is_complex():
        return "complex gradients are not supported by Muon"
    if grad.shape != param.shape:
        return f"gradient shape {tuple(grad.shape)} differs from the parameter's {tuple(param.shape)}"
    if isinstance(param, DTensor) != isinstance(grad, DTensor):
        return "the parameter and its gradient must both be DTensors or both plain tensors"
    return None


def local_problems(param_groups: Sequence[dict[str, Any]]) -> dict[torch.Tensor, str]:
    """Every grad on this rank that cannot be used, with the reason (host facts only)."""
    return {p: problem for g in param_groups for p in g["params"]
            if p.grad is not None and (problem := grad_problem(p, g["use_muon"]))}


def step_problems(param_groups: Sequence[dict[str, Any]], name_of: Callable[[torch.Tensor], str],
                  shard_problem: Callable[[Callable[[torch.Tensor], str]], str | None]
                  ) -> tuple[dict[torch.Tensor, str], list[str]]:
    """This rank's own problems with a step: its invalid grads (by parameter) and every
    problem as the message it raises (``shard_problem``: a wrong shard's, or None)."""
    invalid = local_problems(param_groups)
    problems = [f"parameter {name_of(p)!r}: {why}" for p, why in invalid.items()]
    if shards := shard_problem(name_of):
        problems.append(shards)
    return invalid, problems


def distributed(param: torch.Tensor) -> bool:
    """Whether a Muon parameter's step may involve other ranks: a DTensor (on a mesh of one
    rank too, so that every DTensor takes the one masked step)."""
    return isinstance(param, DTensor)


@dataclass
class RankSet:
    """The distributed Muon parameters of one set of ranks, and where their status is summed."""

    params: list[DTensor]
    names: list[str]
    """The parameters' names, for the error of a later step."""
    group: dist.ProcessGroup
    device: torch.device


def rank_sets(muon_params: Sequence[torch.Tensor], name_of: Callable[[torch.Tensor], str]) -> list[RankSet]:
    """The distributed Muon parameters by rank set, in first-seen order (every rank the
    same). Made once, at planning: a group no mesh provides is made here, never in a
    steady step."""
    found: dict[tuple[int, ...], list[DTensor]] = {}
    for param in muon_params:
        if distributed(param):
            found.setdefault(mesh_ranks(param.device_mesh), []).append(param)
    return [RankSet(params, [name_of(p) for p in params], group_of(ranks, [p.device_mesh for p in params]),
                    mesh_device(params[0].device_mesh))
            for ranks, params in found.items()]


class StatusMasks(Mapping[torch.Tensor, torch.Tensor]):
    """Each distributed Muon parameter's mask, a 0-dim bool on its mesh's device, once the
    step's status sums arrive. The sums are started by :meth:`GradStatus.agree` and waited
    for at the first mask read (or :meth:`finish`), so the host work in between (the
    Muon part's bookkeeping) overlaps the collective's latency; membership needs no wait."""

    def __init__(self, sets: Sequence[tuple[RankSet, torch.Tensor, Any]], pending: list[tuple[list[str], HostCopy]]
                 ) -> None:
        self._sets = sets  # (rank set, status tensor, its all_reduce in flight or None)
        self._pending = pending
        self._keys = {p: None for rank_set, _, _ in sets for p in rank_set.params}
        self._oks: dict[torch.Tensor, torch.Tensor] | None = None

    def finish(self) -> dict[torch.Tensor, torch.Tensor]:
        """Wait for the sums (on the device: no host read), make the masks, and send the sums
        to the host for the next step's :meth:`GradStatus.raise_pending`; once."""
        if self._oks is None:
            self._oks = {}
            for rank_set, status, work in self._sets:
                if work is not None:
                    work.wait()
                n = len(rank_set.params)
                # Counting the ranks with and without a grad (rather than comparing one count with
                # the group's size) gives the right answer on a group whose sums are local too.
                ok = (status[:n] > 0) & (status[n : 2 * n] == 0) & (status[2 * n] == 0)
                self._oks.update(zip(rank_set.params, ok.unbind()))
                self._pending.append((rank_set.names, HostCopy(status)))
        return self._oks

    def __getitem__(self, param: torch.Tensor) -> torch.Tensor:
        return (self._oks if self._oks is not None else self.finish())[param]  # read per parameter: no call once made

    def __contains__(self, param: object) -> bool:
        return param in self._keys

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class GradStatus:
    """One optimizer's status channel: :meth:`agree` each step, :meth:`raise_pending` at
    the start of the next."""

    def __init__(self) -> None:
        self._pending: list[tuple[list[str], HostCopy]] = []
        self._sets: list[RankSet] | None = None  # made at the first step (its groups with them)

    def agree(self, muon_params: Sequence[torch.Tensor], name_of: Callable[[torch.Tensor], str],
              has_grad: Callable[[torch.Tensor], bool], problem_here: bool) -> StatusMasks:
        """Start summing every rank's status per rank set (one device ``all_reduce`` each,
        asynchronous) and return the masks that read the sums (:class:`StatusMasks`)."""
        if self._sets is None:
            self._sets = rank_sets(muon_params, name_of)
        started = []
        for rank_set in self._sets:
            has = [int(has_grad(p)) for p in rank_set.params]
            status = to_device([*has, *(1 - h for h in has), int(problem_here)], rank_set.device, STATUS_DTYPE)
            work = None
            if dist.get_world_size(rank_set.group) > 1:
                work = dist.all_reduce(status, group=rank_set.group, async_op=True)
            started.append((rank_set, status, work))
        return StatusMasks(started, self._pending)

    def raise_pending(self) -> None:
        """Raise the previous step's problem, if its status showed one (on every rank alike)."""
        pending, self._pending = self._pending, []
        problems = 0
        uneven: list[str] = []
        for names, copy in pending:
            if copy.deferred():  # a CUDA graph is being captured: read it at a later step
                self._pending.append((names, copy))
                continue
            sums = copy.read()
            if sums is None:  # a fake run's: no values
                continue
            n = len(names)
            problems = max(problems, sums[2 * n])
            uneven += [name for name, yes, no in zip(names, sums[:n], sums[n : 2 * n]) if yes and no]
        if problems:
            raise ValueError(
                f"DMuon: {problems} rank(s) found an invalid gradient or shard in the previous step; see their "
                "error message. That step changed no distributed Muon parameter or state on any rank.")
        if uneven:
            raise RuntimeError(
                f"DMuon: ranks disagree on which parameters have gradients: {uneven} had a grad on some ranks "
                "but not on others in the previous step, which changed none of them. Every rank must produce "
                "the same set of grads (set unused grads to zeros, or to None on every rank).")

    def forget(self) -> None:
        """Drop the rank sets (the Muon parameters changed); made again at the next step."""
        self._sets = None


def usable_grads(muon_params: Sequence[torch.Tensor], problems: Mapping[torch.Tensor, str]
                 ) -> dict[torch.Tensor, torch.Tensor]:
    """Each Muon parameter's usable grad, laid out like the parameter. A grad placed
    otherwise (a ``Partial`` sum) is redistributed: DTensor's own collective, which the
    ranks holding that grad run; such a grad must exist on every rank of its mesh."""
    grads: dict[torch.Tensor, torch.Tensor] = {}
    for param in (p for p in muon_params if p.grad is not None and p not in problems):
        grad = param.grad
        if isinstance(param, DTensor) and grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        grads[param] = grad
    return grads
