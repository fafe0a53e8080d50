"""The owner plan of one group of ranks: its units with their owners and sources, its
batches, and what each rank sends, receives and holds in each batch.

Each unit has one *owner* rank. A unit every holder has whole (an expert its EP rank
holds) is orthogonalized by each holder in place and never travels. The others travel:
the *sources* (the holders of one replica: the owner's) send their blocks to the owner
(*gather*), the owner rebuilds exactly the bf16 matrix a single process would hold,
orthogonalizes it, and sends every holder, every replica included, its block of the
result (*scatter*). Each gather and scatter is one ``all_to_all_single`` per *batch*.

Planning is two steps: owners (``dmuon.plan.owners``), then batches
(``dmuon.plan.batches``). Pure functions of shapes, placements and world sizes: no process
group is touched, so everything here is testable (and ``plan_report`` runs at P = 1024)
without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from dmuon.plan.batches import DEFAULT_BATCH_NUMEL, make_batches
from dmuon.plan.owners import whole_step_owners
from dmuon.plan.schedule import scratch_events
from dmuon.plan.units import ParamSpec, Unit, make_units, owned_cost

# Wire dtype size: blocks travel in bf16.
WIRE_BYTES = 2


@dataclass(frozen=True)
class OwnerPlan:
    """Owners and batches for the Muon units of one group of ranks."""

    world_size: int
    params: tuple[ParamSpec, ...]
    units: tuple[Unit, ...]
    batches: tuple[tuple[int, ...], ...]
    """Unit indices of each batch, in execution order (each a gather and a scatter)."""

    # ------------------------------------------------------------ per-batch queries

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
        return self._memo(self._gather_splits, batch, rank)

    def _gather_splits(self, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        send = [0] * self.world_size
        recv = [0] * self.world_size
        for index in self.travelling(batch):
            unit = self.units[index]
            if unit.is_source(rank):
                send[unit.owner] += unit.block_numel(rank)
            if unit.owner == rank:
                for source, block in unit.blocks:
                    if unit.is_source(source):
                        recv[source] += block.numel
        return send, recv

    def scatter_splits(self, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        """Element counts ``(send, recv)`` per peer rank for sending results back.

        Send layout: by holder rank, then ``batch`` order, the holder's block of each
        result this rank owns. Receive layout: by owner rank, then ``batch`` order, this
        rank's block of each travelling unit it holds. (Without replicas this is the
        gather reversed; with them, every replica's holders receive.)
        """
        return self._memo(self._scatter_splits, batch, rank)

    def _scatter_splits(self, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        send = [0] * self.world_size
        recv = [0] * self.world_size
        for index in self.travelling(batch):
            unit = self.units[index]
            recv[unit.owner] += unit.block_numel(rank)
            if unit.owner == rank:
                for holder, block in unit.blocks:
                    send[holder] += block.numel
        return send, recv

    def _memo(self, splits, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        """``splits(batch, rank)``, computed once per plan: the step, the byte count, the
        scratch prediction and the cost model all ask for the same splits, and at
        P ranks each costs O(P * units). Copies, so a caller may modify what it gets."""
        key = (splits.__name__, tuple(batch), rank)
        if key not in self._splits:
            self._splits[key] = splits(batch, rank)
        send, recv = self._splits[key]
        return list(send), list(recv)

    @cached_property
    def _splits(self) -> dict[tuple[str, tuple[int, ...], int], tuple[list[int], list[int]]]:
        return {}

    # ------------------------------------------------------------ what it costs

    def bytes_sent(self, rank: int, element_size: int = WIRE_BYTES) -> int:
        """Bytes ``rank`` sends to other ranks in one full step (gathers and scatters)."""
        total = 0
        for batch in self.batches:
            for send, _ in (self.gather_splits(batch, rank), self.scatter_splits(batch, rank)):
                total += sum(send) - send[rank]  # nothing counts for oneself
        return total * element_size

    def ns_flops(self, rank: int, batch: Sequence[int] | None = None) -> int:
        """Newton-Schulz flops ``rank`` runs in ``batch`` (default: the whole step)."""
        return owned_cost(self.units, range(len(self.units)) if batch is None else batch, rank)

    @cached_property
    def ns_critical_path_flops(self) -> int:
        """Sum over batches of the largest per-rank Newton-Schulz flops in that batch."""
        return sum(max(self.ns_flops(r, b) for r in range(self.world_size)) for b in self.batches)

    def peak_scratch_bytes(self, rank: int) -> int:
        """The most bytes of step scratch ``rank`` holds at once: bf16 send, receive,
        full-matrix and result buffers and update copies, as the step allocates and
        frees them (see :func:`scratch_events`). Newton-Schulz's own workspace (about
        ``2 (m n + m^2)`` bf16 elements for the matrix in hand) comes on top."""
        live = peak = 0
        for numel in scratch_events(self, rank):
            live += numel
            peak = max(peak, live)
        return peak * WIRE_BYTES


def make_owner_plan(
    params: Sequence[ParamSpec | Sequence[int]],
    world_size: int,
    max_batch_numel: int = DEFAULT_BATCH_NUMEL,
    split_replicas: bool = True,
) -> OwnerPlan:
    """Plan owners and batches for ``params`` (specs, or plain shapes row-sharded with
    ``Shard(0)`` over all ranks) on ``world_size`` plan ranks (see :func:`make_units`
    for ``split_replicas``)."""
    specs = tuple(p if isinstance(p, ParamSpec) else ParamSpec(tuple(p)) for p in params)
    units = make_units(specs, world_size, split_replicas)
    owners = whole_step_owners(units, world_size)
    replicas = [spec.layout_on(world_size).replica() for spec in specs]
    units = [
        replace(u, owner=o, sources=tuple(r for r in u.holders if replicas[u.param][r] == replicas[u.param][o]))
        for u, o in zip(units, owners)
    ]
    return OwnerPlan(world_size, specs, tuple(units), make_batches(units, world_size, max_batch_numel))
