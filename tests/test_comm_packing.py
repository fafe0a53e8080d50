"""pack/unpack of the all_to_all buffers (dmuon.comm), with P ranks simulated in one process.

``_all_to_all`` routes the send buffers exactly as ``all_to_all_single`` would: rank r's
buffer is cut by its send splits, piece o goes to rank o, and each rank concatenates
what it receives in source-rank order.
"""

from __future__ import annotations

import pytest
import torch

from dmuon.comm import WIRE_DTYPE, pack_gather, pack_scatter, unpack_gather, unpack_scatter
from dmuon.newton_schulz import matrix_shape, orthogonalize
from dmuon.plan import OwnerPlan, make_owner_plan

# Uneven shards (10 rows over 4), empty shards (3 rows over 4, 2 rows over 4),
# a 3-D expert stack and a tall matrix (its orthogonalized form is a transposed view).
SHAPES = [(10, 6), (3, 5), (4, 2, 3), (16, 4), (2, 9), (5, 5)]


def _all_to_all(sends: list[torch.Tensor], send_splits: list[list[int]]) -> list[torch.Tensor]:
    world_size = len(sends)
    pieces = [list(torch.split(send, splits)) for send, splits in zip(sends, send_splits)]
    for send, splits in zip(sends, send_splits):
        assert send.numel() == sum(splits)
    return [torch.cat([pieces[source][dest] for source in range(world_size)]) for dest in range(world_size)]


def _full_matrices(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(WIRE_DTYPE) for shape in shapes]


def _local_rows(plan: OwnerPlan, full: list[torch.Tensor], rank: int) -> dict[int, torch.Tensor]:
    """Rank ``rank``'s rows of every matrix, as FSDP2's Shard(0) would hold them."""
    local = {}
    for i, matrix in enumerate(full):
        rows = plan.layouts[i].rows
        start = sum(rows[:rank])
        local[i] = matrix[start : start + rows[rank]]
    return local


def _orthogonalize_param(matrix: torch.Tensor) -> torch.Tensor:
    return orthogonalize(matrix.reshape(matrix_shape(matrix.shape))).reshape(matrix.shape)


def _gather(plan: OwnerPlan, batch: list[int], full: list[torch.Tensor]) -> list[dict[int, torch.Tensor]]:
    world_size = plan.world_size
    sends = [
        pack_gather(plan, batch, rank, {i: _local_rows(plan, full, rank)[i] for i in batch})
        for rank in range(world_size)
    ]
    send_splits = [plan.gather_splits(batch, rank)[0] for rank in range(world_size)]
    recvs = _all_to_all(sends, send_splits)
    for rank in range(world_size):
        assert recvs[rank].numel() == sum(plan.gather_splits(batch, rank)[1])
    return [unpack_gather(plan, batch, rank, recvs[rank]) for rank in range(world_size)]


def _scatter(plan: OwnerPlan, batch: list[int], owned: list[dict[int, torch.Tensor]]) -> list[dict[int, torch.Tensor]]:
    world_size = plan.world_size
    sends = [pack_scatter(plan, batch, rank, owned[rank]) for rank in range(world_size)]
    # The scatter sends what the gather received: the gather's receive splits.
    send_splits = [plan.gather_splits(batch, rank)[1] for rank in range(world_size)]
    recvs = _all_to_all(sends, send_splits)
    return [unpack_scatter(plan, batch, rank, recvs[rank]) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("max_batch_numel", [40, 1 << 27])
def test_gather_gives_each_owner_exactly_its_full_matrices(world_size, max_batch_numel):
    plan = make_owner_plan(SHAPES, world_size, ns_steps=5, max_batch_numel=max_batch_numel)
    full = _full_matrices(SHAPES)
    for batch in plan.batches:
        received = _gather(plan, list(batch), full)
        for rank in range(world_size):
            assert sorted(received[rank]) == sorted(i for i in batch if plan.owners[i] == rank)
            for i, matrix in received[rank].items():
                assert matrix.shape == full[i].shape
                assert torch.equal(matrix, full[i])


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("max_batch_numel", [40, 1 << 27])
def test_scatter_gives_each_rank_exactly_its_rows_of_the_results(world_size, max_batch_numel):
    plan = make_owner_plan(SHAPES, world_size, ns_steps=5, max_batch_numel=max_batch_numel)
    full = _full_matrices(SHAPES)
    results = [_orthogonalize_param(matrix) for matrix in full]
    for batch in plan.batches:
        owned = [
            {i: _orthogonalize_param(m) for i, m in gathered.items()} for gathered in _gather(plan, list(batch), full)
        ]
        local = _scatter(plan, list(batch), owned)
        for rank in range(world_size):
            expected = _local_rows(plan, results, rank)
            assert sorted(local[rank]) == sorted(batch)
            for i in batch:
                assert local[rank][i].shape == expected[i].shape
                assert torch.equal(local[rank][i], expected[i])


def test_scatter_accepts_non_contiguous_results():
    """A tall matrix comes back from Newton-Schulz as a transposed view."""
    plan = make_owner_plan([(16, 4)], 2, ns_steps=5)
    result = torch.randn(4, 16).to(WIRE_DTYPE).T
    assert not result.is_contiguous()
    local = _scatter(plan, [0], [{0: result} if plan.owners[0] == rank else {} for rank in range(2)])
    assert torch.equal(local[0][0], result[:8])
    assert torch.equal(local[1][0], result[8:])


def test_rank_with_no_rows_and_no_owned_matrix_sends_and_receives_nothing():
    """3 rows over 4 ranks: rank 3 holds no rows; one matrix means ranks 1-3 own nothing."""
    plan = make_owner_plan([(3, 5)], 4, ns_steps=5)
    assert plan.owners == (0,) and plan.layouts[0].rows == (1, 1, 1, 0)
    full = _full_matrices([(3, 5)])

    send = pack_gather(plan, [0], 3, _local_rows(plan, full, 3))
    assert send.numel() == 0 and send.dtype == WIRE_DTYPE
    assert plan.gather_splits([0], 3) == ([0, 0, 0, 0], [0, 0, 0, 0])

    received = _gather(plan, [0], full)
    assert torch.equal(received[0][0], full[0])
    assert received[1] == received[2] == received[3] == {}

    local = _scatter(plan, [0], [{0: full[0] * 2}, {}, {}, {}])
    assert local[3][0].shape == (0, 5)
    assert torch.equal(local[1][0], full[0][1:2] * 2)


def test_empty_batch_packs_empty_bf16_buffers_and_unpacks_to_nothing():
    plan = make_owner_plan(SHAPES, 3, ns_steps=5)
    empty = torch.empty(0, dtype=WIRE_DTYPE)
    for rank in range(3):
        for send in (pack_gather(plan, [], rank, {}), pack_scatter(plan, [], rank, {})):
            assert send.numel() == 0 and send.dtype == WIRE_DTYPE
        assert unpack_gather(plan, [], rank, empty) == {}
        assert unpack_scatter(plan, [], rank, empty) == {}
        assert plan.gather_splits([], rank) == ([0, 0, 0], [0, 0, 0])


def test_gather_buffer_is_ordered_by_owner_then_batch_order():
    plan = OwnerPlan(
        world_size=2,
        layouts=make_owner_plan([(2, 2)] * 3, 2, ns_steps=5).layouts,
        owners=(1, 0, 1),
        batches=((0, 1, 2),),
    )
    local = {i: torch.full((1, 2), float(i), dtype=WIRE_DTYPE) for i in range(3)}
    send = pack_gather(plan, [0, 1, 2], 0, local)
    assert send.tolist() == [1.0, 1.0, 0.0, 0.0, 2.0, 2.0]  # owner 0: matrix 1; owner 1: matrices 0, 2
