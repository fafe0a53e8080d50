"""pack/unpack of the all_to_all buffers (dmuon.exchange.packing), with P ranks simulated in one process.

``_all_to_all`` routes the send buffers exactly as ``all_to_all_single`` would: rank r's
buffer is cut by its send splits, piece o goes to rank o, and each rank concatenates
what it receives in source-rank order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon.exchange.comm import WIRE_DTYPE, CommStats, Exchange, ScratchMeter
from dmuon.exchange.packing import gather_whole, pack_gather, pack_scatter, scatter_blocks
from dmuon.numerics.newton_schulz import orthogonalize
from dmuon.plan import OwnerPlan, ParamSpec, make_owner_plan
from dmuon.plan.layout import Layout
from dmuon.plan.pack_layout import make_batch_layout

pytestmark = pytest.mark.unit


def unpack_gather(plan: OwnerPlan, batch, rank: int, recv: torch.Tensor) -> dict[int, torch.Tensor]:
    """Whole matrices of the travelling units ``rank`` owns (views of one new buffer)."""
    return gather_whole(plan, make_batch_layout(plan, batch, rank), recv)[1]


def unpack_scatter(plan: OwnerPlan, batch, rank: int, recv: torch.Tensor) -> dict[int, torch.Tensor]:
    """``rank``'s block (a view of ``recv``, in its block shape) of every travelling unit it holds."""
    layout = make_batch_layout(plan, batch, rank)
    return {i: view.view(plan.units[i].block(rank).shape)
            for i, view in zip(layout.scatter_recv_units, scatter_blocks(layout, recv))}

CPU = torch.device("cpu")
# Uneven shards (10 rows over 4), empty shards (3 rows over 4, 2 rows over 4), a tall
# matrix (its orthogonalized form is a transposed view), a column-sharded matrix, and
# expert stacks sharded on each of their three dims.
SPECS = [
    ParamSpec((10, 6)),
    ParamSpec((3, 5)),
    ParamSpec((16, 4)),
    ParamSpec((2, 9)),
    ParamSpec((5, 11), shard_dim=1),
    ParamSpec((4, 2, 3)),
    ParamSpec((3, 6, 5), shard_dim=1),
    ParamSpec((2, 5, 7), shard_dim=2),
]


def _all_to_all(sends: list[torch.Tensor], send_splits: list[list[int]]) -> list[torch.Tensor]:
    world_size = len(sends)
    for send, splits in zip(sends, send_splits):
        assert send.numel() == sum(splits)
    pieces = [list(torch.split(send, splits)) for send, splits in zip(sends, send_splits)]
    return [torch.cat([pieces[source][dest] for source in range(world_size)]) for dest in range(world_size)]


def _full_params(specs: list[ParamSpec]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(spec.shape, generator=generator).to(WIRE_DTYPE) for spec in specs]


def _local_shard(spec: ParamSpec, full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The part of ``full`` DTensor's placements give ``rank`` (its box; the layout
    module's boxes are checked against DTensor's own in tests/test_layout.py)."""
    box = spec.layout_on(world_size).boxes(spec.shape)[rank]
    return full[tuple(slice(start, start + length) for start, length in box)]


def _unit_matrix(plan: OwnerPlan, i: int, full: list[torch.Tensor]) -> torch.Tensor:
    unit = plan.units[i]
    return full[unit.param][unit.dim0[0] : unit.dim0[1]].reshape(unit.matrix)


def _each(block_of):
    """The packer asks for lists of blocks; these tests make them one by one."""
    return lambda units: [block_of(i) for i in units]


def _block_of(plan: OwnerPlan, full: list[torch.Tensor], rank: int):
    def block_of(i: int) -> torch.Tensor:
        unit = plan.units[i]
        local = _local_shard(plan.params[unit.param], full[unit.param], plan.world_size, rank)
        block = unit.block(rank)
        return local[block.lo : block.hi].reshape(block.shape)

    return _each(block_of)


def _gather(plan: OwnerPlan, batch: list[int], full: list[torch.Tensor]) -> list[dict[int, torch.Tensor]]:
    world_size = plan.world_size
    sends = [pack_gather(plan, batch, rank, _block_of(plan, full, rank), CPU) for rank in range(world_size)]
    recvs = _all_to_all(sends, [plan.gather_splits(batch, rank)[0] for rank in range(world_size)])
    for rank in range(world_size):
        assert recvs[rank].numel() == sum(plan.gather_splits(batch, rank)[1])
    return [unpack_gather(plan, batch, rank, recvs[rank]) for rank in range(world_size)]


def _scatter(plan: OwnerPlan, batch: list[int], owned: list[dict[int, torch.Tensor]]) -> list[dict[int, torch.Tensor]]:
    world_size = plan.world_size
    sends = [pack_scatter(plan, batch, rank, dict(owned[rank]), CPU) for rank in range(world_size)]
    recvs = _all_to_all(sends, [plan.scatter_splits(batch, rank)[0] for rank in range(world_size)])
    return [unpack_scatter(plan, batch, rank, recvs[rank]) for rank in range(world_size)]


# Four ranks on a 2 x 2 mesh: HSDP, FSDP over TP (rows and columns), EP + FSDP expert
# stacks, EP experts replicated, and TP columns replicated over data parallel.
MESH_SPECS = [
    ParamSpec((10, 6), layout=Layout.hsdp(2, 2)),
    ParamSpec((9, 7), layout=Layout((2, 2), (_StridedShard(0, split_factor=2), Shard(0)))),
    ParamSpec((6, 10), layout=Layout((2, 2), (Shard(0), Shard(1)))),
    ParamSpec((4, 6, 5), layout=Layout((2, 2), (Shard(1), Shard(0)))),
    ParamSpec((4, 3, 5), layout=Layout((2, 2), (Replicate(), Shard(0)))),
    ParamSpec((5, 8), layout=Layout((2, 2), (Replicate(), Shard(1)))),
]
# Row-sharded matrices only (packed with splits), their column counts falling in batch
# order (the owner's whole buffer groups them by column count), uneven at P = 3.
ROW_SPECS = [ParamSpec((7, 9)), ParamSpec((5, 4)), ParamSpec((8, 6)), ParamSpec((4, 3)), ParamSpec((6, 9))]
CASES = [(SPECS, world, True) for world in (2, 3, 4)] + [(MESH_SPECS, 4, split) for split in (True, False)]
CASES += [(ROW_SPECS, world, True) for world in (2, 3)]
CASE_IDS = ["1d-P2", "1d-P3", "1d-P4", "2x2-split", "2x2-apart", "rows-P2", "rows-P3"]


@pytest.mark.parametrize(("specs", "world_size", "split"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("max_batch_numel", [40, 1 << 27])
def test_gather_gives_each_owner_exactly_its_whole_matrices(specs, world_size, split, max_batch_numel):
    plan = make_owner_plan(specs, world_size, max_batch_numel=max_batch_numel, split_replicas=split)
    full = _full_params(specs)
    for batch in plan.batches:
        received = _gather(plan, list(batch), full)
        for rank in range(world_size):
            assert sorted(received[rank]) == [i for i in plan.travelling(batch) if plan.units[i].owner == rank]
            for i, matrix in received[rank].items():
                assert torch.equal(matrix, _unit_matrix(plan, i, full))


@pytest.mark.parametrize(("specs", "world_size", "split"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("max_batch_numel", [40, 1 << 27])
def test_scatter_gives_each_holder_exactly_its_block_of_the_results(specs, world_size, split, max_batch_numel):
    plan = make_owner_plan(specs, world_size, max_batch_numel=max_batch_numel, split_replicas=split)
    full = _full_params(specs)
    results = [orthogonalize(_unit_matrix(plan, i, full)) for i in range(len(plan.units))]
    for batch in plan.batches:
        owned = [{i: orthogonalize(m) for i, m in gathered.items()} for gathered in _gather(plan, list(batch), full)]
        local = _scatter(plan, list(batch), owned)
        for rank in range(world_size):
            held = [i for i in plan.travelling(batch) if plan.units[i].block(rank)]
            assert sorted(local[rank]) == held
            for i in held:
                (row, col), (rows, cols) = plan.units[i].block(rank).offset, plan.units[i].block(rank).shape
                assert torch.equal(local[rank][i], results[i][row : row + rows, col : col + cols])


def test_scatter_accepts_non_contiguous_results():
    """A tall matrix comes back from Newton-Schulz as a transposed view."""
    plan = make_owner_plan([(16, 4)], 2)
    result = torch.randn(4, 16).to(WIRE_DTYPE).T
    assert not result.is_contiguous()
    local = _scatter(plan, [0], [{0: result} if plan.units[0].owner == rank else {} for rank in range(2)])
    assert torch.equal(local[0][0], result[:8])
    assert torch.equal(local[1][0], result[8:])


def test_rank_with_no_rows_and_no_owned_matrix_sends_and_receives_nothing():
    """3 rows over 4 ranks: rank 3 holds no rows; one matrix means ranks 1-3 own nothing."""
    plan = make_owner_plan([(3, 5)], 4)
    assert plan.units[0].owner == 0 and plan.units[0].holders == (0, 1, 2)
    full = _full_params([ParamSpec((3, 5))])

    send = pack_gather(plan, [0], 3, _block_of(plan, full, 3), CPU)
    assert send.numel() == 0 and send.dtype == WIRE_DTYPE
    assert plan.gather_splits([0], 3) == ([0, 0, 0, 0], [0, 0, 0, 0])

    received = _gather(plan, [0], full)
    assert torch.equal(received[0][0], full[0])
    assert received[1] == received[2] == received[3] == {}

    local = _scatter(plan, [0], [{0: full[0] * 2}, {}, {}, {}])
    assert 0 not in local[3]
    assert torch.equal(local[1][0], full[0][1:2] * 2)


def test_gather_buffer_is_ordered_by_owner_then_batch_order():
    plan = make_owner_plan([(2, 2)] * 3, 2)
    units = tuple(dataclasses.replace(u, owner=owner) for u, owner in zip(plan.units, (1, 0, 1)))
    plan = OwnerPlan(2, plan.params, units, ((0, 1, 2),))
    send = pack_gather(plan, [0, 1, 2], 0, _each(lambda i: torch.full((1, 2), float(i), dtype=WIRE_DTYPE)), CPU)
    assert send.tolist() == [1.0, 1.0, 0.0, 0.0, 2.0, 2.0]  # owner 0: matrix 1; owner 1: matrices 0, 2


# ------------------------------------------------------------------ devices


def test_empty_buffers_are_made_on_the_device_asked_for():
    """A rank with nothing to send must still hand NCCL a buffer on the GPU, not the CPU."""
    meta = torch.device("meta")
    plan = make_owner_plan([(3, 5)], 4)
    assert pack_gather(plan, [0], 3, lambda i: pytest.fail("rank 3 holds no block"), meta).device == meta
    assert pack_scatter(plan, [0], 3, {}, meta).device == meta
    assert pack_gather(plan, [], 0, lambda i: pytest.fail("empty batch"), meta).device == meta


def test_pack_and_unpack_run_on_meta_tensors_of_every_layout():
    meta = torch.device("meta")
    plan = make_owner_plan(SPECS, 4, max_batch_numel=40)
    whole, blocks_back = [], []  # (unit, rank) of every matrix and block unpacked
    for batch in plan.batches:
        for rank in range(4):
            send = pack_gather(plan, batch, rank, _each(lambda i: torch.empty(plan.units[i].block(rank).shape,
                                                                              dtype=WIRE_DTYPE, device=meta)), meta)
            assert send.device == meta and send.numel() == sum(plan.gather_splits(batch, rank)[0])
            recv = torch.empty(sum(plan.gather_splits(batch, rank)[1]), dtype=WIRE_DTYPE, device=meta)
            full = unpack_gather(plan, batch, rank, recv)
            assert all(m.device == meta and m.shape == plan.units[i].matrix for i, m in full.items())
            whole += [(i, rank) for i in full]
            back = pack_scatter(plan, batch, rank, dict(full), meta)
            assert back.device == meta and back.numel() == sum(plan.scatter_splits(batch, rank)[0])
            recv = torch.empty(sum(plan.scatter_splits(batch, rank)[1]), dtype=WIRE_DTYPE, device=meta)
            blocks = unpack_scatter(plan, batch, rank, recv)
            assert all(b.device == meta for b in blocks.values())
            blocks_back += [(i, rank) for i in blocks]
    # Every travelling matrix came whole to its owner, and went back to every rank holding a block of it.
    travelling = [i for batch in plan.batches for i in plan.travelling(batch)]
    assert travelling
    assert sorted(whole) == sorted((i, plan.units[i].owner) for i in travelling)
    assert sorted(blocks_back) == sorted((i, r) for i in travelling for r in range(4) if plan.units[i].block(r))


def test_exchange_refuses_a_buffer_off_the_mesh_device_before_any_collective():
    send = torch.empty(0, dtype=WIRE_DTYPE)  # CPU, while the mesh is on "meta"
    with pytest.raises(RuntimeError, match="mesh's device"):
        Exchange(send, [0], [0], group=None, group_rank=0, stats=CommStats(), device=torch.device("meta"))


# ------------------------------------------------------------------ scratch meter


def test_scratch_meter_counts_tensors_from_track_to_free():
    meter = ScratchMeter()
    a = meter.track(torch.empty(10, dtype=WIRE_DTYPE))
    b = meter.track(torch.empty(5, dtype=WIRE_DTYPE))
    assert meter.live_bytes == meter.peak_bytes == 30
    meter.free(a)
    assert meter.live_bytes == 10 and meter.peak_bytes == 30
    meter.reset_peak()
    assert meter.peak_bytes == 10
    meter.free(b)
    assert meter.live_bytes == 0


def test_scratch_meter_refuses_to_free_a_tensor_twice():
    meter = ScratchMeter()
    a = meter.track(torch.empty(4, dtype=WIRE_DTYPE))
    meter.free(a)
    with pytest.raises(KeyError):
        meter.free(a)


# ------------------------------------------------------------------ ops per batch


def _packing_ops(n_matrices: int, world_size: int) -> int:
    """Aten ops one batch of ``n_matrices`` (of two shapes) takes to pack and unpack on rank 0."""
    from dmuon.exchange.packing import scatter_blocks
    from dmuon.plan.pack_layout import make_batch_layout
    from dmuon.torch_compat import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    specs = [ParamSpec((8, 4) if i % 2 else (4, 12)) for i in range(n_matrices)]
    plan = make_owner_plan(specs, world_size)
    batch = tuple(range(len(plan.units)))
    plan = dataclasses.replace(plan, batches=(batch,))  # every matrix in one batch
    full = _full_params(specs)
    made = {i: _block_of(plan, full, 0)([i])[0] for i in batch if plan.units[i].block(0)}
    sends = [pack_gather(plan, batch, rank, _block_of(plan, full, rank), CPU) for rank in range(world_size)]
    recv = _all_to_all(sends, [plan.gather_splits(batch, rank)[0] for rank in range(world_size)])[0]
    layout = make_batch_layout(plan, batch, 0)
    scatter_recv = torch.empty(sum(plan.scatter_splits(batch, 0)[1]), dtype=WIRE_DTYPE)
    with Count():
        pack_gather(plan, batch, 0, lambda units: [made[i] for i in units], CPU, layout=layout)
        owned = unpack_gather(plan, batch, 0, recv)
        pack_scatter(plan, batch, 0, dict(owned), CPU, layout=layout)
        scatter_blocks(layout, scatter_recv)
    return Count.ops


@pytest.mark.parametrize("world_size", [2, 3])
def test_packing_a_batch_takes_the_same_ops_for_12_or_48_matrices(world_size):
    """Splits, ``_foreach_copy_`` and ``_chunk_cat``: a few ops per batch and direction,
    not a slice and a copy per block (uneven rows at P = 3, even chunks at P = 2)."""
    assert _packing_ops(12, world_size) == _packing_ops(48, world_size)


def test_equal_row_chunks_on_every_rank_are_packed_chunk_by_chunk():
    from dmuon.plan.pack_layout import make_batch_layout

    plan = make_owner_plan([(8, 4), (6, 6)], 2)
    assert all(make_batch_layout(plan, batch, rank).even_rows for batch in plan.batches for rank in range(2))
    assert not make_batch_layout(make_owner_plan([(5, 4)], 2), (0,), 0).even_rows  # 5 rows: uneven
