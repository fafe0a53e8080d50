"""Who orthogonalizes which matrix, in which batch, and which blocks travel where.

Pure functions of shapes, placements and world sizes: no process group is touched,
so everything here is testable (and ``plan_report`` runs at P = 1024) without processes.

Vocabulary:

- a *unit* is one matrix Newton-Schulz runs on: a 2-D parameter (or one block of
  ``split_rows`` rows of it: an attention head), one expert of a 3-D ``[E, A, B]``
  stack, or a 4-D+ parameter seen as ``[shape[0], prod(rest)]``;
- on a 1-D mesh with placement ``Shard(d)``, rank ``r`` holds one *block* of every unit
  it touches: a slice of the unit along one matrix dimension (rows for FSDP2's
  ``Shard(0)``, columns for a ``Shard(1)`` weight), cut the way ``torch.chunk`` cuts
  (DTensor's rule: uneven, possibly empty on the last ranks);
- each unit has one *owner* rank. A unit whose blocks all live on one rank (an expert
  that rank holds whole) is owned there and never travels. The others travel: every
  holder sends its block to the owner (*gather*), the owner rebuilds exactly the bf16
  matrix a single process would hold, orthogonalizes it, and sends each holder its
  block of the result (*scatter*). Each gather and scatter is one ``all_to_all_single``
  per *batch*.

Planning is two steps. Owners: longest-processing-time (LPT) over the whole step, by
Newton-Schulz flops, so every rank carries the same cost. Batches: cut only so that
communication overlaps Newton-Schulz and scratch memory stays bounded; each batch is a
"shelf" whose height is the largest remaining unit, filled by every rank up to that
height, so every rank has work in every batch and the step's critical path (the sum of
the batches' slowest ranks) stays close to the whole-step LPT bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import accumulate
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dmuon.newton_schulz import DEFAULT_NS_STEPS, matrix_shape, newton_schulz_flops

# How a Muon parameter reaches Newton-Schulz.
LOCAL = "local"  # the rank already holds the whole matrix: plain tensor or Replicate
ALL_TO_ALL = "all_to_all"  # fast path: 1-D mesh, Shard(d), owner-computed
REDISTRIBUTE = "redistribute"  # reference path: all-gather to every rank, slice back
COMM_CHOICES = (ALL_TO_ALL, REDISTRIBUTE)

# Each rank owns at most this many elements of travelling matrices in one batch, or
# as many as the batch's tallest matrix when that one is larger (its owner needs that
# much anyway). It bounds the per-batch scratch buffers; see
# ``OwnerPlan.peak_scratch_bytes``.
DEFAULT_BATCH_NUMEL = 1 << 27
# Shelves are merged into about this many batches when memory allows: enough for the
# next batch's gather and the previous batch's scatter to hide behind Newton-Schulz,
# few enough to keep the number of collectives small.
OVERLAP_BATCHES = 4
# Wire dtype size: blocks travel in bf16.
WIRE_BYTES = 2


def comm_path(param: torch.Tensor, comm: str) -> str:
    """Which path a Muon parameter takes, given ``comm`` (``"all_to_all"`` or ``"redistribute"``).

    Raises ``ValueError`` for placements no optimizer step can use (``Partial``).
    """
    if not isinstance(param, DTensor):
        return LOCAL
    placements = param.placements
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"a Partial placement {placements} cannot hold a parameter")
    if all(isinstance(p, Replicate) for p in placements):
        return LOCAL
    if comm == REDISTRIBUTE or param.device_mesh.ndim != 1:
        return REDISTRIBUTE
    placement = placements[0]
    # Exactly Shard: _StridedShard (FSDP + TP) subclasses Shard and reorders rows.
    if type(placement) is not Shard or cat_dim(param.ndim, placement.dim) is None:
        return REDISTRIBUTE
    return LOCAL if param.device_mesh.size() == 1 else ALL_TO_ALL


def cat_dim(ndim: int, shard_dim: int) -> int | None:
    """The unit-matrix dimension along which ``Shard(shard_dim)`` cuts a parameter of
    ``ndim`` dims into blocks, or None when a block is not a slice of the matrix
    (a 4-D+ weight sharded past dim 0: its flattened columns interleave)."""
    if shard_dim == 0:
        return 0
    if ndim == 2 and shard_dim == 1:
        return 1
    if ndim == 3 and shard_dim in (1, 2):
        return shard_dim - 1  # [E, A, B]: dim 1 cuts an expert's rows, dim 2 its columns
    return None


def shard_sizes(size: int, world_size: int) -> tuple[int, ...]:
    """Extent each rank holds of a dim of ``size`` under ``Shard`` (``torch.chunk``'s split).

    ``shard_sizes(10, 4) == (3, 3, 3, 1)`` and ``shard_sizes(3, 4) == (1, 1, 1, 0)``.
    """
    chunk = -(-size // world_size)  # ceil division
    return tuple(max(0, min(size, (r + 1) * chunk) - r * chunk) for r in range(world_size))


def shard_starts(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each rank's shard begins: the prefix sums of ``sizes``."""
    return (0, *accumulate(sizes))[: len(sizes)]


def assign_owners(costs: Sequence[int], world_size: int, loads: Sequence[int] | None = None) -> tuple[int, ...]:
    """Balance costs over ranks: longest job first, each to the least-loaded rank.

    ``loads`` are costs the ranks already carry. Ties (equal cost, equal load) go to
    the lower index and the lower rank, so every rank computes the same assignment.
    For equal costs on idle ranks this is round-robin.
    """
    owners = [0] * len(costs)
    heap = [(0 if loads is None else loads[rank], rank) for rank in range(world_size)]
    heapq.heapify(heap)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + costs[index], rank))
    return tuple(owners)


@dataclass(frozen=True)
class ParamSpec:
    """One Muon parameter as the planner sees it."""

    shape: tuple[int, ...]
    """Global shape."""
    shard_dim: int = 0
    """The dim ``Shard`` cuts over the mesh."""
    ns_steps: int = DEFAULT_NS_STEPS
    """Newton-Schulz iterations of its group (the cost model)."""
    split_rows: int | None = None
    """Rows per separately orthogonalized block of a 2-D parameter (an attention head)."""

    @property
    def unit_rows(self) -> int:
        """Indices of dim 0 per unit: one expert of a 3-D stack, one block of
        ``split_rows`` rows, or else the whole parameter."""
        if len(self.shape) == 3:
            return 1
        return self.split_rows or self.shape[0]

    @property
    def num_units(self) -> int:
        return self.shape[0] // self.unit_rows if self.shape[0] else 0


@dataclass(frozen=True)
class Unit:
    """One matrix of the plan and where its blocks live."""

    param: int
    """Index of its parameter in ``OwnerPlan.params``."""
    dim0: tuple[int, int]
    """The ``[start, stop)`` range of its parameter's dim 0 it covers."""
    matrix: tuple[int, int]
    """The 2-D shape Newton-Schulz sees."""
    cat_dim: int
    """Matrix dim along which the ranks' blocks are concatenated."""
    extents: tuple[int, ...]
    """Each rank's block size along ``cat_dim`` (0: the rank holds none of it)."""
    cost: int
    """Newton-Schulz flops."""
    travels: bool
    """False when one rank holds the whole matrix (it is then the owner, and nothing moves)."""
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.matrix[0] * self.matrix[1]

    def block_numel(self, rank: int) -> int:
        return self.extents[rank] * self.matrix[1 - self.cat_dim]

    def block_shape(self, rank: int) -> tuple[int, int]:
        shape = list(self.matrix)
        shape[self.cat_dim] = self.extents[rank]
        return (shape[0], shape[1])


@dataclass(frozen=True)
class OwnerPlan:
    """Owners and batches for the Muon units of one 1-D mesh."""

    world_size: int
    params: tuple[ParamSpec, ...]
    units: tuple[Unit, ...]
    batches: tuple[tuple[int, ...], ...]
    """Unit indices of each batch, in execution order (each a gather and a scatter)."""

    # ------------------------------------------------------------ where blocks live

    def local_dim0(self, unit: Unit, rank: int) -> tuple[int, int] | None:
        """The ``[lo, hi)`` slice of dim 0 of ``rank``'s local tensor that holds its block
        of ``unit`` (the block is that slice reshaped to ``unit.block_shape(rank)``),
        or None when the rank holds none of it."""
        if not unit.extents[rank]:
            return None
        if self.params[unit.param].shard_dim != 0:  # every rank holds all of dim 0
            return unit.dim0
        start, size = self._dim0_shards[unit.param][rank]
        return (max(unit.dim0[0], start) - start, min(unit.dim0[1], start + size) - start)

    def block_offset(self, unit: Unit, rank: int) -> int:
        """Where ``rank``'s block starts along ``unit.cat_dim`` of the whole matrix."""
        return sum(unit.extents[:rank])

    @cached_property
    def _dim0_shards(self) -> list[list[tuple[int, int]]]:
        """Per parameter, each rank's ``(start, size)`` along dim 0."""
        shards = []
        for spec in self.params:
            sizes = shard_sizes(spec.shape[0], self.world_size)
            shards.append(list(zip(shard_starts(sizes), sizes)))
        return shards

    # ------------------------------------------------------------ per-batch queries

    def travelling(self, batch: Sequence[int]) -> list[int]:
        return [i for i in batch if self.units[i].travels]

    def kept_local(self, batch: Sequence[int], rank: int) -> list[int]:
        """Units of ``batch`` that ``rank`` holds whole and orthogonalizes in place."""
        return [i for i in batch if not self.units[i].travels and self.units[i].owner == rank]

    def gather_splits(self, batch: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
        """Element counts ``(send, recv)`` per peer rank for gathering ``batch`` to owners.

        Send buffer layout: by owner rank, then in ``batch`` order, this rank's block of
        each travelling unit that owner owns. Receive layout: by source rank, then in
        ``batch`` order, the source's block of each travelling unit this rank owns.
        The scatter uses the same counts with send and receive swapped.
        """
        send = [0] * self.world_size
        recv = [0] * self.world_size
        for index in self.travelling(batch):
            unit = self.units[index]
            send[unit.owner] += unit.block_numel(rank)
            if unit.owner == rank:
                for peer in range(self.world_size):
                    recv[peer] += unit.block_numel(peer)
        return send, recv

    # ------------------------------------------------------------ what it costs

    def bytes_sent(self, rank: int, element_size: int = WIRE_BYTES) -> int:
        """Bytes ``rank`` sends to other ranks in one full step (gathers and scatters)."""
        total = 0
        for batch in self.batches:
            send, recv = self.gather_splits(batch, rank)
            # The scatter sends what the gather received; nothing counts for oneself.
            total += sum(send) - send[rank] + sum(recv) - recv[rank]
        return total * element_size

    def ns_flops(self, rank: int, batch: Sequence[int] | None = None) -> int:
        """Newton-Schulz flops ``rank`` runs in ``batch`` (default: the whole step)."""
        return _load(self.units, range(len(self.units)) if batch is None else batch, rank)

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


def scratch_events(plan: OwnerPlan, rank: int) -> list[int]:
    """The step's scratch allocations (+numel) and frees (-numel) on ``rank``, in order.

    This is the schedule ``dmuon.owner_step`` executes, written as arithmetic:

    - start gather(b): send buffer; per travelling block: update copy, packed, freed;
      receive buffer;
    - for each batch b: gather(b) done (send freed); the owned full matrices are cut
      from the receive buffer (receive freed); start gather(b + 1); units kept local:
      update copy, result, both freed; owned travelling units: result, full matrix
      freed; scatter send packed from the results (results freed); scatter receive;
      scatter(b - 1) done: send freed, blocks applied, receive freed.
    """
    events: list[int] = []
    sizes = []
    for batch in plan.batches:
        send, recv = plan.gather_splits(batch, rank)
        blocks = [plan.units[i].block_numel(rank) for i in plan.travelling(batch) if plan.units[i].extents[rank]]
        owned = [plan.units[i].numel for i in plan.travelling(batch) if plan.units[i].owner == rank]
        local = [plan.units[i].numel for i in plan.kept_local(batch, rank)]
        sizes.append((sum(send), sum(recv), blocks, owned, local))

    def start_gather(b: int) -> None:
        send, recv, blocks, _, _ = sizes[b]
        events.append(send)
        for block in blocks:
            events.extend((block, -block))
        events.append(recv)

    if not sizes:
        return events
    start_gather(0)
    for b, (send, recv, _, owned, local) in enumerate(sizes):
        events.extend((-send, sum(owned), -recv))
        if b + 1 < len(sizes):
            start_gather(b + 1)
        for numel in local:
            events.extend((numel, numel, -numel, -numel))
        for numel in owned:
            events.extend((numel, -numel))
        events.extend((sum(owned), -sum(owned), send))  # scatter send, results freed, scatter receive
        if b > 0:
            previous_send, _, _, previous_owned, _ = sizes[b - 1]
            events.extend((-sum(previous_owned), -previous_send))
    last_send, _, _, last_owned, _ = sizes[-1]
    events.extend((-sum(last_owned), -last_send))
    return events


def make_units(params: Sequence[ParamSpec], world_size: int) -> list[Unit]:
    """Every parameter cut into units, with each rank's block extent."""
    units = []
    for index, spec in enumerate(params):
        ndim = len(spec.shape)
        dim = cat_dim(ndim, spec.shard_dim)
        if dim is None:
            raise ValueError(f"a {ndim}-D parameter sharded on dim {spec.shard_dim} has no block layout")
        rows_per_index = spec.shape[1] if ndim == 3 else 1  # matrix rows per index of dim 0
        sizes = shard_sizes(spec.shape[spec.shard_dim], world_size)
        starts = shard_starts(sizes)
        for u in range(spec.num_units):
            lo, hi = u * spec.unit_rows, (u + 1) * spec.unit_rows
            matrix = matrix_shape((hi - lo,) + spec.shape[1:])[-2:]
            if spec.shard_dim == 0:  # a rank's block is its share of this unit's dim-0 range
                extents = tuple(
                    max(0, min(hi, s + n) - max(lo, s)) * rows_per_index for s, n in zip(starts, sizes)
                )
            else:
                extents = sizes
            cost = newton_schulz_flops(matrix, spec.ns_steps)
            travels = sum(1 for e in extents if e) > 1
            units.append(Unit(index, (lo, hi), (matrix[0], matrix[1]), dim, extents, cost, travels))
    return units


def make_owner_plan(
    params: Sequence[ParamSpec | Sequence[int]],
    world_size: int,
    max_batch_numel: int = DEFAULT_BATCH_NUMEL,
) -> OwnerPlan:
    """Plan owners and batches for ``params`` (specs, or plain shapes row-sharded with
    ``Shard(0)``) on a 1-D mesh of ``world_size`` ranks."""
    specs = tuple(p if isinstance(p, ParamSpec) else ParamSpec(tuple(p)) for p in params)
    units = make_units(specs, world_size)
    owners = _whole_step_owners(units, world_size)
    units = [replace(u, owner=o) for u, o in zip(units, owners)]
    return OwnerPlan(world_size, specs, tuple(units), _batches(units, world_size, max_batch_numel))


def lpt_bound_flops(plan: OwnerPlan) -> int:
    """The largest per-rank Newton-Schulz load of a whole-step LPT assignment with no
    batching: the best any whole-matrix ownership can do (rank loads are the plan's)."""
    return max(plan.ns_flops(r) for r in range(plan.world_size)) if plan.units else 0


def _whole_step_owners(units: Sequence[Unit], world_size: int) -> tuple[int, ...]:
    """A unit held whole by one rank stays there; the rest go LPT over the whole step."""
    owners = [0] * len(units)
    loads = [0] * world_size
    free: list[int] = []
    for i, unit in enumerate(units):
        if unit.travels:
            free.append(i)
        else:  # an empty unit (no elements) also lands here, on rank 0: it costs nothing
            holder = next((r for r, e in enumerate(unit.extents) if e), 0)
            owners[i] = holder
            loads[holder] += unit.cost
    for i, owner in zip(free, assign_owners([units[i].cost for i in free], world_size, loads)):
        owners[i] = owner
    return tuple(owners)


def _batches(units: Sequence[Unit], world_size: int, max_batch_numel: int) -> tuple[tuple[int, ...], ...]:
    """Shelves (every rank fills each up to its tallest unit), merged under the memory cap."""
    shelves = _shelves(units, world_size, max_batch_numel)
    if not shelves:
        return ()
    heights = [max(_load(units, shelf, r) for r in range(world_size)) for shelf in shelves]
    target = sum(heights) / OVERLAP_BATCHES
    batches: list[list[int]] = []
    height = 0
    for shelf, shelf_height in zip(shelves, heights):
        merged = (batches[-1] + shelf) if batches else None
        if merged is not None and height + shelf_height <= target and _fits(units, merged, world_size, max_batch_numel):
            batches[-1] = merged
            height += shelf_height
        else:
            batches.append(list(shelf))
            height = shelf_height
    return tuple(tuple(sorted(batch)) for batch in batches)


def _shelves(units: Sequence[Unit], world_size: int, max_batch_numel: int) -> list[list[int]]:
    """First-fit decreasing shelves: each shelf's height is the tallest unit any rank
    has left; every rank then packs its own remaining units (largest first) into the
    shelf while they fit under that height and its travelling elements stay within
    ``max(max_batch_numel, the tallest unit's elements)``: that unit's owner needs that
    much scratch for the shelf anyway, and a rank with several smaller units then runs
    them in the tallest unit's shadow instead of in extra batches."""
    queues: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(units)), key=lambda i: (-units[i].cost, i)):
        queues[units[i].owner].append(i)
    shelves = []
    while any(queues):
        tallest = units[max((q[0] for q in queues if q), key=lambda i: (units[i].cost, -i))]
        height = tallest.cost
        allowance = max(max_batch_numel, tallest.numel if tallest.travels else 0)
        shelf: list[int] = []
        for r, queue in enumerate(queues):
            load = numel = 0
            rest = []
            for position, i in enumerate(queue):
                unit = units[i]
                size = unit.numel if unit.travels else 0
                fits = load + unit.cost <= height and numel + size <= allowance
                if position == 0 or fits:
                    shelf.append(i)
                    load += unit.cost
                    numel += size
                else:
                    rest.append(i)
                    if load + units[queue[-1]].cost > height:  # not even the smallest fits
                        rest.extend(queue[position + 1 :])
                        break
            queues[r] = rest
        shelves.append(shelf)
    return shelves


def _load(units: Sequence[Unit], batch: Sequence[int], rank: int) -> int:
    return sum(units[i].cost for i in batch if units[i].owner == rank)


def _fits(units: Sequence[Unit], batch: Sequence[int], world_size: int, cap: int) -> bool:
    owned = [0] * world_size
    for i in batch:
        if units[i].travels:
            owned[units[i].owner] += units[i].numel
    return max(owned) <= cap
