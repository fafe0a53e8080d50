"""Who orthogonalizes which matrix, in which batch, and which blocks travel where.

Pure functions of shapes, placements and world sizes: no process group is touched,
so everything here is testable (and ``plan_report`` runs at P = 1024) without processes.

Vocabulary:

- a *unit* is one matrix Newton-Schulz runs on: a 2-D parameter (or one block of
  ``split_rows`` rows of it: an attention head), one expert of a 3-D ``[E, A, B]``
  stack, or a 4-D+ parameter seen as ``[shape[0], prod(rest)]``;
- each rank holds one *block* of every unit it touches: the part of the unit inside
  the rank's box of the parameter (``dmuon.layout``: DTensor's placement rules on any
  mesh, so FSDP's rows, TP's columns, FSDP over TP, an EP rank's experts); under
  ``Replicate`` mesh dims (HSDP) every replica holds the same blocks;
- each unit has one *owner* rank. A unit every holder has whole (an expert its EP rank
  holds) is orthogonalized by each holder in place and never travels. The others
  travel: the *sources* (the holders of one replica: the owner's) send their blocks
  to the owner (*gather*), the owner rebuilds exactly the bf16 matrix a single process
  would hold, orthogonalizes it, and sends every holder, every replica included, its
  block of the result (*scatter*). Each gather and scatter is one
  ``all_to_all_single`` per *batch*.

Planning is two steps. Owners: longest-processing-time (LPT) over the whole step, by
Newton-Schulz flops, so every rank carries the same cost. Batches: cut only so that
communication overlaps Newton-Schulz and scratch memory stays bounded; each batch is a
"shelf" whose height is the largest remaining unit, filled by every rank up to that
height, so every rank has work in every batch and the step's critical path (the sum of
the batches' slowest ranks) stays close to the whole-step LPT bound.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from dmuon.layout import Box, Layout
from dmuon.mesh_facts import mesh_ranks_in_order
from dmuon.newton_schulz import (
    DEFAULT_GRAM_RESTARTS, DEFAULT_NS_ALGORITHM, DEFAULT_NS_STEPS, matrix_shape, newton_schulz_flops,
)

# How a Muon parameter reaches Newton-Schulz.
LOCAL = "local"  # the rank already holds the whole matrix: plain tensor or Replicate
ALL_TO_ALL = "all_to_all"  # fast path: owner-computed, blocks moved by all_to_all
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

# The events of one step of the owner exchange, per batch (see :func:`batch_schedule`).
START_GATHER = "start_gather"  # momentum, pack the blocks, start the gather all_to_all
FINISH_GATHER = "finish_gather"  # wait for it; owners cut their whole matrices out
NEWTON_SCHULZ = "newton_schulz"  # the batch's kept-local and owned units
START_SCATTER = "start_scatter"  # pack the results, start the scatter all_to_all
FINISH_SCATTER = "finish_scatter"  # wait for it; apply the returned blocks
COLLECTIVE_EVENTS = (START_GATHER, FINISH_GATHER, START_SCATTER, FINISH_SCATTER)


def comm_path(param: torch.Tensor, comm: str) -> str:
    """The path a Muon parameter's placement allows, given ``comm`` (``"all_to_all"`` or
    ``"redistribute"``): the first rule of ``dmuon.paths.choose_paths``, which decides.

    Raises ``ValueError`` for placements no optimizer step can use (``Partial``).
    """
    if not isinstance(param, DTensor):
        return LOCAL
    placements = param.placements
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"a Partial placement {placements} cannot hold a parameter")
    if all(isinstance(p, Replicate) for p in placements):
        return LOCAL
    if comm == REDISTRIBUTE:
        return REDISTRIBUTE
    if param.device_mesh.size() == 1:
        return LOCAL
    return REDISTRIBUTE if layout_problem(param.shape, layout_of(param)) else ALL_TO_ALL


def layout_of(param: DTensor, plan_rank: Mapping[int, int] | None = None) -> Layout:
    """A DTensor's layout; ``plan_rank`` maps global ranks to plan ranks (default: same)."""
    mesh = param.device_mesh
    ranks = list(mesh_ranks_in_order(mesh))
    if plan_rank is not None:
        ranks = [plan_rank[r] for r in ranks]
    return Layout(tuple(mesh.shape), tuple(param.placements), tuple(ranks))


def assign_owners(
    costs: Sequence[int],
    world_size: int,
    loads: Sequence[int] | None = None,
    candidates: Sequence[tuple[int, ...]] | None = None,
) -> tuple[int, ...]:
    """Balance costs over ranks: longest job first, each to the least-loaded rank (of
    ``candidates[i]``, the ranks job ``i`` may go to; default: every rank).

    ``loads`` are costs the ranks already carry. Ties (equal cost, equal load) go to
    the lower index and the lower rank, so every rank computes the same assignment.
    For equal costs on idle ranks this is round-robin.
    """
    loads = [0] * world_size if loads is None else list(loads)
    everyone = tuple(range(world_size))
    owners = [0] * len(costs)
    # One heap per candidate set; an entry whose load is stale is refreshed on pop.
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        ranks = everyone if candidates is None else candidates[index]
        heap = heaps.get(ranks)
        if heap is None:
            heap = heaps[ranks] = [(loads[r], r) for r in ranks]
            heapq.heapify(heap)
        load, rank = heapq.heappop(heap)
        while load != loads[rank]:
            load, rank = heapq.heappushpop(heap, (loads[rank], rank))
        owners[index] = rank
        loads[rank] += costs[index]
        heapq.heappush(heap, (loads[rank], rank))
    return tuple(owners)


@dataclass(frozen=True)
class ParamSpec:
    """One Muon parameter as the planner sees it."""

    shape: tuple[int, ...]
    """Global shape."""
    shard_dim: int = 0
    """Without ``layout``: the dim ``Shard`` cuts over a 1-D mesh of every plan rank."""
    ns_steps: int = DEFAULT_NS_STEPS
    """Newton-Schulz iterations of its group (the cost model)."""
    ns_algorithm: str = DEFAULT_NS_ALGORITHM
    """Its group's ``ns_algorithm``, as resolved for the device (``resolve_ns_algorithm``):
    what each unit costs."""
    ns_gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS
    """Its group's ``ns_gram_restarts``."""
    split_rows: int | None = None
    """Rows per separately orthogonalized block of a 2-D parameter (an attention head)."""
    layout: Layout | None = None
    """Its mesh and placements (``dmuon.layout``); None: ``Layout.sharded(P, shard_dim)``."""

    def layout_on(self, world_size: int) -> Layout:
        return self.layout if self.layout is not None else Layout.sharded(world_size, self.shard_dim)

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
class Block:
    """The part of one unit one rank holds."""

    lo: int
    hi: int
    """The ``[lo, hi)`` slice of dim 0 of the rank's local tensor that holds it."""
    shape: tuple[int, int]
    """That slice seen as a matrix block."""
    offset: tuple[int, int]
    """Where the block sits in the unit's matrix (row, column)."""

    @cached_property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class Unit:
    """One matrix of the plan, who holds which block of it, and who orthogonalizes it."""

    param: int
    """Index of its parameter in ``OwnerPlan.params``."""
    dim0: tuple[int, int]
    """The ``[start, stop)`` range of its parameter's dim 0 it covers."""
    matrix: tuple[int, int]
    """The 2-D shape Newton-Schulz sees."""
    cost: int
    """Newton-Schulz flops."""
    blocks: tuple[tuple[int, Block], ...]
    """``(rank, block)`` of every rank holding part of it (its *holders*), by rank. They
    all get their block of the result back."""
    candidates: tuple[int, ...]
    """Ranks that may own it (its parameter's mesh, or one replica of it)."""
    owner: int = 0
    sources: tuple[int, ...] = ()
    """Holders that send their block to the owner: exactly one copy of every element
    (the owner's replica when the parameter is replicated)."""

    @property
    def numel(self) -> int:
        return self.matrix[0] * self.matrix[1]

    @property
    def holders(self) -> tuple[int, ...]:
        return tuple(rank for rank, _ in self.blocks)

    @cached_property
    def travels(self) -> bool:
        """False when one rank holds the whole matrix (it owns it, and nothing moves)."""
        return len(self.blocks) > 1

    def block(self, rank: int) -> Block | None:
        return self._by_rank.get(rank)

    def block_numel(self, rank: int) -> int:
        block = self._by_rank.get(rank)
        return block.numel if block else 0

    def is_source(self, rank: int) -> bool:
        return rank in self._sources

    def place(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Where ``rank``'s block sits in the matrix: ``(offset, shape)`` (replicas share it)."""
        block = self._by_rank[rank]
        return block.offset, block.shape

    @cached_property
    def sources_by_offset(self) -> tuple[int, ...]:
        """The sources, in the order their blocks lie in the matrix."""
        return tuple(sorted((s for s in self.sources if self.block(s)), key=lambda s: self._by_rank[s].offset))

    @cached_property
    def rows_only(self) -> bool:
        """Its sources' blocks are consecutive runs of whole rows covering the matrix,
        and every holder's block is one of them: each block is one contiguous range of
        the matrix, so the owner exchange packs it with splits (``dmuon.packing``)."""
        start = 0
        for source in self.sources_by_offset:
            (row, col), (rows, cols) = self.place(source)
            if (row, col) != (start, 0) or cols != self.matrix[1]:
                return False
            start += rows
        places = {self.place(s) for s in self.sources}
        return start == self.matrix[0] and all(self.place(holder) in places for holder in self.holders)

    def even_rows(self, world_size: int) -> bool:
        """Rank ``h`` of ``world_size`` holds rows ``[h m/P, (h+1) m/P)`` of every column
        (FSDP's ``Shard(0)`` of a matrix whose rows P divides, no replicas): the layout
        FSDP2 packs its reduce-scatter with, so the owner exchange packs results by chunks."""
        rows, cols = self.matrix
        if rows % world_size or self.holders != tuple(range(world_size)):
            return False
        chunk = rows // world_size
        return all(self.place(h) == ((h * chunk, 0), (chunk, cols)) for h in self.holders)

    @cached_property
    def _by_rank(self) -> dict[int, Block]:
        return dict(self.blocks)

    @cached_property
    def _sources(self) -> frozenset[int]:
        return frozenset(self.sources)


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


def batch_schedule(n_batches: int) -> tuple[tuple[str, int], ...]:
    """The owner exchange's order of events, ``(event, batch)``, for ``n_batches`` batches.

    Written once, as data: ``dmuon.transport.owner_exchange`` executes it, and
    :func:`scratch_events` (memory) and ``dmuon.cost_model.overlapped_ms`` (time) read
    it. Batch ``b``'s gather finishes, then gather ``b + 1`` starts, so it travels while
    this rank runs batch ``b``'s Newton-Schulz; scatter ``b`` starts once its results
    exist, and scatter ``b - 1`` finishes only after that, so it too travels during
    Newton-Schulz ``b``. At most three batches' buffers are alive at once.
    """
    if n_batches <= 0:
        return ()
    events = [(START_GATHER, 0)]
    for b in range(n_batches):
        events.append((FINISH_GATHER, b))
        if b + 1 < n_batches:
            events.append((START_GATHER, b + 1))
        events += [(NEWTON_SCHULZ, b), (START_SCATTER, b)]
        if b > 0:
            events.append((FINISH_SCATTER, b - 1))
    events.append((FINISH_SCATTER, n_batches - 1))
    return tuple(events)


def scratch_events(plan: OwnerPlan, rank: int) -> list[int]:
    """The step's scratch allocations (+numel) and frees (-numel) on ``rank``, in order:
    :func:`batch_schedule`, each event as the buffers it makes and frees.

    - start gather(b): send buffer (each chunk's blocks packed straight into it: their
      look-ahead is the elementwise scratch of ``dmuon.dry_run.memory_bound``); receive buffer;
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


def layout_problem(shape: Sequence[int], layout: Layout) -> str | None:
    """Why the owner exchange cannot move this parameter's blocks (None: it can)."""
    boxes = layout.boxes(shape)
    if any(box is None for box in boxes.values()):
        return "some rank's shard is not one contiguous block"
    if len(shape) >= 4 and any(box[d] != (0, shape[d]) for box in boxes.values() for d in range(1, len(shape)) if box[0][1]):
        return "a 4-D+ weight sharded past dim 0 (its flattened columns interleave)"
    return None


def _block(shape: Sequence[int], box: Box | None, dim0: tuple[int, int]) -> Block | None:
    """The block of the unit covering ``dim0`` that a rank holding ``box`` has."""
    if box is None or any(length == 0 for _, length in box):
        return None
    start, length = box[0]
    lo, hi = max(start, dim0[0]), min(start + length, dim0[1])
    if lo >= hi:
        return None
    if len(shape) == 3:  # one expert: the box's rows and columns of it
        (row, rows), (col, cols) = box[1], box[2]
        return Block(lo - start, hi - start, (rows, cols), (row, col))
    cols = math.prod(length for _, length in box[1:])
    return Block(lo - start, hi - start, (hi - lo, cols), (lo - dim0[0], box[1][0] if len(shape) == 2 else 0))


def make_units(params: Sequence[ParamSpec], world_size: int, split_replicas: bool = True) -> list[Unit]:
    """Every parameter cut into units, each with its holders' blocks and the ranks
    that may own it.

    A unit every holder has whole (an expert held whole by its EP rank, on every
    replica) becomes one unit per holder, owned there: no communication. Otherwise, on
    a replicated parameter, ``split_replicas`` makes one unit that any rank of the
    mesh may own (Newton-Schulz split over all replicas; the result goes back to every
    replica); without it, each replica gets its own copy of the unit, owned inside
    the replica (every replica runs Newton-Schulz on every matrix, as FSDP2 Muon does).
    """
    units = []
    for index, spec in enumerate(params):
        layout = spec.layout_on(world_size)
        problem = layout_problem(spec.shape, layout)
        if problem:
            raise ValueError(f"parameter {index} of shape {spec.shape}: {problem}")
        boxes = layout.boxes(spec.shape)
        replica = layout.replica()
        mesh_ranks = tuple(sorted(layout.mesh_ranks))
        replicas = sorted(set(replica.values()))
        for u in range(spec.num_units):
            dim0 = (u * spec.unit_rows, (u + 1) * spec.unit_rows)
            matrix = matrix_shape((dim0[1] - dim0[0],) + spec.shape[1:])[-2:]
            matrix = (matrix[0], matrix[1])
            cost = newton_schulz_flops(matrix, spec.ns_steps, spec.ns_algorithm, spec.ns_gram_restarts)
            blocks = [(r, b) for r in mesh_ranks if (b := _block(spec.shape, boxes[r], dim0))]
            if not blocks:
                continue
            if all(b.numel == matrix[0] * matrix[1] for _, b in blocks):
                units += [Unit(index, dim0, matrix, cost, ((r, b),), (r,)) for r, b in blocks]
            elif split_replicas or len(replicas) == 1:
                units.append(Unit(index, dim0, matrix, cost, tuple(blocks), mesh_ranks))
            else:
                for key in replicas:
                    members = tuple(r for r in mesh_ranks if replica[r] == key)
                    units.append(Unit(index, dim0, matrix, cost, tuple((r, b) for r, b in blocks if replica[r] == key), members))
    return units


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
    owners = _whole_step_owners(units, world_size)
    replicas = [spec.layout_on(world_size).replica() for spec in specs]
    units = [
        replace(u, owner=o, sources=tuple(r for r in u.holders if replicas[u.param][r] == replicas[u.param][o]))
        for u, o in zip(units, owners)
    ]
    return OwnerPlan(world_size, specs, tuple(units), _batches(units, world_size, max_batch_numel))


def lpt_bound_flops(plan: OwnerPlan) -> int:
    """The largest per-rank Newton-Schulz load of a whole-step LPT assignment with no
    batching: the best any whole-matrix ownership can do (rank loads are the plan's)."""
    return max(plan.ns_flops(r) for r in range(plan.world_size)) if plan.units else 0


def _whole_step_owners(units: Sequence[Unit], world_size: int) -> tuple[int, ...]:
    """A unit with one candidate (held whole there) is owned there; the rest go LPT over
    the whole step (:func:`assign_owners`), each to one of its candidate ranks."""
    owners = [0] * len(units)
    loads = [0] * world_size
    free: list[int] = []
    for i, unit in enumerate(units):
        if len(unit.candidates) == 1:
            owners[i] = unit.candidates[0]
            loads[owners[i]] += unit.cost
        else:
            free.append(i)
    chosen = assign_owners([units[i].cost for i in free], world_size, loads, [units[i].candidates for i in free])
    for i, owner in zip(free, chosen):
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
