"""The owner plan of one group of ranks: its units with their owners and sources, its
batches, and what each rank sends, receives and holds in each batch.

Each unit has one *owner* rank. A unit every holder has whole (an expert its EP rank
holds) is orthogonalized by each holder in place and never travels. The others travel:
the *sources* (the holders of one replica: the owner's) send their blocks to the owner
(*gather*), the owner rebuilds exactly the bf16 matrix a single process would hold,
orthogonalizes it, and sends every holder, every replica included, its block of the
result (*scatter*). Each gather and scatter is one ``all_to_all_single`` per *batch*.
Planning: owners (``dmuon.plan.owners``), then batches (``dmuon.plan.batches``). Pure.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TypeVar

from dmuon.plan.batches import DEFAULT_BATCH_NUMEL, make_batches
from dmuon.plan.cutting import make_units
from dmuon.plan.layout import Layout
from dmuon.plan.owners import whole_step_owners
from dmuon.plan.schedule import FINISH_GATHER, NEWTON_SCHULZ, START_GATHER, START_SCATTER, batch_schedule
from dmuon.plan.units import ParamSpec, Unit, owned_costs

# Wire dtype size: blocks travel in bf16.
WIRE_BYTES = 2

T = TypeVar("T")


@dataclass(frozen=True)
class OwnerPlan:
    """Owners and batches for the Muon units of one group of ranks."""

    world_size: int
    params: tuple[ParamSpec, ...]
    units: tuple[Unit, ...]
    batches: tuple[tuple[int, ...], ...]
    """Unit indices of each batch, in execution order (each a gather and a scatter)."""

    def travelling(self, batch: Sequence[int]) -> list[int]:
        return [i for i in batch if self.units[i].travels]

    def kept_local(self, batch: Sequence[int], rank: int) -> list[int]:
        """Units of ``batch`` that ``rank`` holds whole and orthogonalizes in place."""
        return [i for i in batch if not self.units[i].travels and self.units[i].owner == rank]

    def gather_splits(self, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        """Element counts ``(send, recv)`` per peer rank for gathering ``batch`` to owners.

        Send buffer layout: by owner rank, then in ``batch`` order, this rank's block of
        each travelling unit it is a source of. Receive layout: by source rank, then in
        ``batch`` order, the source's block of each travelling unit this rank owns.
        """
        return self._memo(True, batch, rank)

    def scatter_splits(self, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        """Element counts ``(send, recv)`` per peer rank for sending results back.

        Send layout: by holder rank, then ``batch`` order, the holder's block of each
        result this rank owns. Receive layout: by owner rank, then ``batch`` order, this
        rank's block of each travelling unit it holds. (Without replicas this is the
        gather reversed; with them, every replica's holders receive.)
        """
        return self._memo(False, batch, rank)

    def _count(self, gather: bool, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        send = [0] * self.world_size
        recv = [0] * self.world_size
        mine = _by_kind(lambda unit: unit.block_numel(rank))
        # The units this rank owns are all in its replica: their sources depend on their kind alone.
        peers = _by_kind(lambda unit: [(r, n) for r, n in unit.holder_numels()
                                       if not gather or unit.in_owner_replica(r)])
        for index in self.travelling(batch):
            unit = self.units[index]
            if not gather:
                recv[unit.owner] += mine(unit)
            elif mine(unit) and unit.in_owner_replica(rank):
                send[unit.owner] += mine(unit)
            if unit.owner == rank:
                counts = recv if gather else send
                for peer, numel in peers(unit):
                    counts[peer] += numel
        return send, recv

    def _memo(self, gather: bool, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        """The splits, computed once per plan and rank: the step, the byte count, the scratch
        prediction and the memory bound all ask for this rank's same splits. Memory: only
        the last rank asked about is kept (a rank's plan asks about itself; a tool asking
        about every rank recomputes), each split as an integer array, so a plan keeps
        O(batches x P) integers, not O(batches x P^2). Copies, so a caller may modify them."""
        memo = self._splits  # {rank: {(gather, batch): (send, recv)}}, for one rank
        if rank not in memo:
            memo.clear()
        splits = memo.setdefault(rank, {})
        key = (gather, tuple(batch))
        if key not in splits:
            send, recv = self._count(gather, batch, rank)
            # Signed 64-bit, 8 bytes a count (a list of Python ints costs about 36).
            splits[key] = (array("q", send), array("q", recv))
        send, recv = splits[key]
        return list(send), list(recv)

    @cached_property
    def _splits(self) -> dict[int, dict[tuple[bool, tuple[int, ...]], tuple[array, array]]]:
        return {}

    def bytes_sent(self, rank: int, element_size: int = WIRE_BYTES) -> int:
        """Bytes ``rank`` sends to other ranks in one full step (gathers and scatters)."""
        total = 0
        for batch in self.batches:
            for send, _ in (self.gather_splits(batch, rank), self.scatter_splits(batch, rank)):
                total += sum(send) - send[rank]  # nothing counts for oneself
        return total * element_size

    def ns_flops(self, rank: int, batch: Sequence[int] | None = None) -> int:
        """Newton-Schulz flops ``rank`` runs in ``batch`` (default: the whole step)."""
        return sum(self.units[i].cost for i in (range(len(self.units)) if batch is None else batch)
                   if self.units[i].owner == rank)

    @cached_property
    def ns_critical_path_flops(self) -> int:
        """Sum over batches of the largest per-rank Newton-Schulz flops in that batch."""
        return sum(max(owned_costs(self.units, b, self.world_size)) for b in self.batches)

    def peak_scratch_bytes(self, rank: int) -> int:
        """The most bytes of step scratch ``rank`` holds at once (:func:`scratch_events`).
        Newton-Schulz's own workspace (about ``2 (m n + m^2)`` bf16 elements for the matrix
        in hand) comes on top."""
        live = peak = 0
        for numel in scratch_events(self, rank):
            live += numel
            peak = max(peak, live)
        return peak * WIRE_BYTES


def make_owner_plan(params: Sequence[ParamSpec | Sequence[int]], world_size: int,
                    max_batch_numel: int = DEFAULT_BATCH_NUMEL, split_replicas: bool = True) -> OwnerPlan:
    """Plan owners and batches for ``params`` (specs, or plain shapes row-sharded with
    ``Shard(0)`` over all ranks) on ``world_size`` plan ranks (see :func:`make_units`
    for ``split_replicas``)."""
    # Equal layouts made one object: the optimizer makes one layout per parameter, each with
    # its mesh's P plan ranks, and the plan keeps its specs, so without this it would keep
    # parameters x P integers.
    shared: dict[Layout, Layout] = {}
    specs = tuple(spec if spec.layout is None else replace(spec, layout=shared.setdefault(spec.layout, spec.layout))
                  for spec in (p if isinstance(p, ParamSpec) else ParamSpec(tuple(p)) for p in params))
    units = make_units(specs, world_size, split_replicas)
    owners = whole_step_owners(units, world_size)
    units = [replace(u, owner=o) for u, o in zip(units, owners)]
    return OwnerPlan(world_size, specs, tuple(units), make_batches(units, world_size, max_batch_numel))


def _by_kind(answer: Callable[[Unit], T]) -> Callable[[Unit], T]:
    """``answer(unit)``, computed once per kind of unit (``Unit.kind``) for one split: a
    batch repeats a few kinds many times, so a rank's splits cost O(batch) lookups and
    O(P) per kind it owns, not O(P) per unit."""
    answers: dict[tuple, T] = {}

    def cached(unit: Unit) -> T:
        kind = unit.kind
        if kind not in answers:
            answers[kind] = answer(unit)
        return answers[kind]
    return cached


def lpt_bound_flops(plan: OwnerPlan) -> int:
    """The largest per-rank Newton-Schulz load of a whole-step LPT assignment with no
    batching: the best any whole-matrix ownership can do (rank loads are the plan's)."""
    return max(owned_costs(plan.units, range(len(plan.units)), plan.world_size)) if plan.units else 0


def scratch_events(plan: OwnerPlan, rank: int) -> list[int]:
    """The step's scratch allocations (+numel) and frees (-numel) on ``rank``, in order:
    ``dmuon.plan.schedule.batch_schedule``, each event as the buffers it makes and frees.

    - start gather(b): send buffer (each chunk's blocks packed straight into it: their look-ahead
      is the elementwise scratch of ``dmuon.tools.dry_run.memory_bound``); receive buffer;
    - finish gather(b): send freed; the owned whole matrices, one buffer, are cut from
      the receive buffer (receive freed);
    - Newton-Schulz(b): units kept local: update copy, result, both freed; owned
      travelling units: their results, then the whole matrices' buffer freed;
    - start scatter(b): the results flattened into one buffer and freed, the send
      buffer filled from it and it freed (even row chunks, blocks of columns: the send
      buffer filled from the results, freed); receive buffer;
    - finish scatter(b): send freed, blocks applied, receive freed.
    """
    sizes = []
    for batch in plan.batches:
        gather_send, gather_recv = plan.gather_splits(batch, rank)
        scatter_send, scatter_recv = plan.scatter_splits(batch, rank)
        owned_units = [plan.units[i] for i in plan.travelling(batch) if plan.units[i].owner == rank]
        owned = [unit.numel for unit in owned_units]
        local = [plan.units[i].numel for i in plan.kept_local(batch, rank)]
        rows_only = all(u.rows_only for u in owned_units) and not all(u.even_rows(plan.world_size) for u in owned_units)
        sizes.append((sum(gather_send), sum(gather_recv), owned, rows_only, local, sum(scatter_send),
                      sum(scatter_recv)))

    events: list[int] = []
    for event, b in batch_schedule(len(sizes)):
        send, recv, owned, rows_only, local, scatter_send, scatter_recv = sizes[b]
        if event == START_GATHER:
            events.extend((send, recv))
        elif event == FINISH_GATHER:
            events.extend((-send, sum(owned), -recv))
        elif event == NEWTON_SCHULZ:
            for numel in local:
                events.extend((numel, numel, -numel, -numel))
            events.extend(owned)  # the results; the whole matrices are one buffer, freed after them
            events.append(-sum(owned))
        elif event == START_SCATTER:
            if rows_only:  # results flattened into one buffer, freed; the send buffer filled from it
                events.extend((sum(owned), -sum(owned), scatter_send, -sum(owned), scatter_recv))
            else:  # the send buffer filled from the results (by chunks, or block by block), freed
                events.extend((scatter_send, -sum(owned), scatter_recv))
        else:
            events.extend((-scatter_send, -scatter_recv))
    return events
