"""Owner and batch planning (dmuon.plan): pure functions of shapes and world sizes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from dmuon.newton_schulz import newton_schulz_flops
from dmuon.plan import (
    ALL_TO_ALL,
    LOCAL,
    REDISTRIBUTE,
    assign_owners,
    comm_path,
    make_owner_plan,
    shard_rows,
    split_into_batches,
)

# ------------------------------------------------------------------ shard_rows


@pytest.mark.parametrize(
    "num_rows, world_size, expected",
    [
        (8, 2, (4, 4)),
        (8, 4, (2, 2, 2, 2)),
        (10, 4, (3, 3, 3, 1)),
        (9, 4, (3, 3, 3, 0)),  # uneven and one empty shard
        (5, 4, (2, 2, 1, 0)),
        (7, 1, (7,)),
    ],
)
def test_shard_rows(num_rows, world_size, expected):
    assert shard_rows(num_rows, world_size) == expected


@pytest.mark.parametrize("num_rows, world_size", [(3, 4), (1, 8), (0, 3)])
def test_shard_rows_with_more_ranks_than_rows_gives_trailing_zeros(num_rows, world_size):
    rows = shard_rows(num_rows, world_size)
    assert rows == (1,) * num_rows + (0,) * (world_size - num_rows)


def test_shard_rows_follows_torch_chunk_like_fsdp2():
    for world_size in range(1, 9):
        for num_rows in range(0, 30):
            chunks = [len(c) for c in torch.arange(num_rows).chunk(world_size)] if num_rows else []
            expected = tuple(chunks) + (0,) * (world_size - len(chunks))
            assert shard_rows(num_rows, world_size) == expected, (num_rows, world_size)


# ------------------------------------------------------------------ assign_owners


def test_assign_owners_is_deterministic():
    costs = [7, 3, 9, 3, 1, 8, 8, 2]
    assert assign_owners(costs, 3) == assign_owners(tuple(costs), 3) == assign_owners(list(costs), 3)


def test_assign_owners_is_longest_processing_time_first():
    # 5 -> r0, 4 -> r1, 3 -> r1 (4 < 5), 3 -> r0 (5 < 7), 3 -> r1 (7 < 8)
    assert assign_owners([5, 4, 3, 3, 3], 2) == (0, 1, 1, 0, 1)


def test_assign_owners_balances_loads_within_one_largest_cost():
    generator = torch.Generator().manual_seed(0)
    costs = torch.randint(1, 1000, (50,), generator=generator).tolist()
    for world_size in (2, 3, 4, 7):
        owners = assign_owners(costs, world_size)
        loads = [sum(c for c, o in zip(costs, owners) if o == rank) for rank in range(world_size)]
        assert max(loads) - min(loads) <= max(costs)


def test_assign_owners_is_round_robin_for_equal_costs():
    assert assign_owners([7] * 7, 3) == (0, 1, 2, 0, 1, 2, 0)


def test_assign_owners_with_fewer_matrices_than_ranks_uses_the_lowest_ranks():
    assert assign_owners([4, 4], 4) == (0, 1)
    assert assign_owners([], 4) == ()


# ------------------------------------------------------------------ split_into_batches


def test_split_into_batches_respects_the_cap():
    numels = [3, 3, 3, 3, 5, 1]
    batches = split_into_batches(numels, 6)
    assert batches == ((0, 1), (2, 3), (4, 5))
    assert all(sum(numels[i] for i in batch) <= 6 for batch in batches)


def test_split_into_batches_keeps_every_index_once_in_order():
    numels = [4, 1, 7, 2, 2, 9, 3]
    batches = split_into_batches(numels, 8)
    assert [i for batch in batches for i in batch] == list(range(len(numels)))


def test_split_into_batches_puts_an_oversized_matrix_alone():
    assert split_into_batches([2, 10, 2], 5) == ((0,), (1,), (2,))
    assert split_into_batches([2, 2, 10], 5) == ((0, 1), (2,))


def test_split_into_batches_of_nothing_is_empty():
    assert split_into_batches([], 5) == ()


def test_one_batch_when_everything_fits():
    assert split_into_batches([1, 2, 3], 6) == ((0, 1, 2),)


# ------------------------------------------------------------------ make_owner_plan

# Uneven shards, empty shards (3 rows over 4 ranks) and a 3-D expert stack.
MIXED_SHAPES = [(10, 6), (3, 5), (4, 2, 3), (7, 7), (16, 4), (2, 9)]


def _llama_like(layers: int, dim: int, hidden: int) -> list[tuple[int, int]]:
    per_layer = [(dim, dim)] * 4 + [(hidden, dim), (dim, hidden), (hidden, dim)]  # wq wk wv wo w1 w2 w3
    return per_layer * layers


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("max_batch_numel", [40, 1 << 27])
def test_gather_splits_agree_between_senders_and_owners(world_size, max_batch_numel):
    """What rank r sends to owner o is exactly what o expects to receive from r."""
    plan = make_owner_plan(MIXED_SHAPES, world_size, ns_steps=5, max_batch_numel=max_batch_numel)
    for batch in plan.batches:
        splits = [plan.gather_splits(batch, rank) for rank in range(world_size)]
        for sender in range(world_size):
            for owner in range(world_size):
                assert splits[sender][0][owner] == splits[owner][1][sender], (batch, sender, owner)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_splits_deliver_every_element_once(world_size):
    plan = make_owner_plan(MIXED_SHAPES, world_size, ns_steps=5, max_batch_numel=40)
    for batch in plan.batches:
        sent = sum(sum(plan.gather_splits(batch, rank)[0]) for rank in range(world_size))
        received_by_owner = [sum(plan.gather_splits(batch, rank)[1]) for rank in range(world_size)]
        owned_numel = [
            sum(torch.Size(plan.layouts[i].shape).numel() for i in batch if plan.owners[i] == rank)
            for rank in range(world_size)
        ]
        assert received_by_owner == owned_numel
        assert sent == sum(torch.Size(plan.layouts[i].shape).numel() for i in batch)


def test_plan_layouts_use_shard_rows():
    plan = make_owner_plan(MIXED_SHAPES, 4, ns_steps=5)
    assert [layout.rows for layout in plan.layouts] == [shard_rows(s[0], 4) for s in MIXED_SHAPES]
    assert plan.layouts[2].row_numel == 6  # (4, 2, 3): one row of dim 0 is 2 x 3


def test_plan_balances_owners_by_newton_schulz_flops_within_each_batch():
    plan = make_owner_plan(MIXED_SHAPES, 3, ns_steps=5, max_batch_numel=40)
    for batch in plan.batches:
        costs = [newton_schulz_flops(MIXED_SHAPES[i], 5) for i in batch]
        assert tuple(plan.owners[i] for i in batch) == assign_owners(costs, 3)


def test_plan_respects_max_batch_numel():
    plan = make_owner_plan(MIXED_SHAPES, 2, ns_steps=5, max_batch_numel=40)
    assert len(plan.batches) > 1
    for batch in plan.batches:
        numel = sum(torch.Size(MIXED_SHAPES[i]).numel() for i in batch)
        assert numel <= 40 or len(batch) == 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_is_a_pth_of_an_all_gather_for_a_balanced_stack(world_size):
    """4 * N * (P - 1) / P^2 bytes per rank: bf16 rows to owners and back, 1/P of an all-gather."""
    shapes = _llama_like(layers=4, dim=64, hidden=128)
    total = sum(rows * cols for rows, cols in shapes)
    plan = make_owner_plan(shapes, world_size, ns_steps=5)
    expected = 4 * total * (world_size - 1) // world_size**2
    assert 4 * total * (world_size - 1) % world_size**2 == 0
    for rank in range(world_size):
        assert plan.bytes_sent(rank) == expected


def test_bytes_sent_counts_element_size():
    plan = make_owner_plan(_llama_like(2, 32, 64), 2, ns_steps=5)
    assert plan.bytes_sent(0, element_size=4) == 2 * plan.bytes_sent(0, element_size=2)


def test_bytes_sent_on_one_rank_is_zero():
    plan = make_owner_plan(MIXED_SHAPES, 1, ns_steps=5)
    assert plan.bytes_sent(0) == 0
    assert set(plan.owners) == {0}


# ------------------------------------------------------------------ comm_path


def test_plain_tensor_takes_the_local_path():
    assert comm_path(torch.zeros(4, 4), ALL_TO_ALL) == LOCAL
    assert comm_path(torch.zeros(4, 4), REDISTRIBUTE) == LOCAL


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo process group, enough to build DTensors in this process."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _dtensor(mesh_shape: tuple[int, ...], placements: list) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    return distribute_tensor(torch.randn(4, 6), mesh, placements)


@pytest.mark.usefixtures("one_rank_group")
def test_replicated_dtensor_takes_the_local_path():
    from torch.distributed.tensor import Replicate

    for comm in (ALL_TO_ALL, REDISTRIBUTE):
        assert comm_path(_dtensor((1,), [Replicate()]), comm) == LOCAL
        assert comm_path(_dtensor((1, 1), [Replicate(), Replicate()]), comm) == LOCAL


@pytest.mark.usefixtures("one_rank_group")
def test_row_sharded_dtensor_on_a_one_rank_mesh_takes_the_local_path():
    from torch.distributed.tensor import Shard

    assert comm_path(_dtensor((1,), [Shard(0)]), ALL_TO_ALL) == LOCAL


@pytest.mark.usefixtures("one_rank_group")
def test_sharded_dtensor_with_comm_redistribute_takes_the_redistribute_path():
    from torch.distributed.tensor import Shard

    assert comm_path(_dtensor((1,), [Shard(0)]), REDISTRIBUTE) == REDISTRIBUTE


@pytest.mark.usefixtures("one_rank_group")
def test_column_sharded_dtensor_takes_the_redistribute_path():
    from torch.distributed.tensor import Shard

    assert comm_path(_dtensor((1,), [Shard(1)]), ALL_TO_ALL) == REDISTRIBUTE


@pytest.mark.usefixtures("one_rank_group")
def test_dtensor_on_a_2d_mesh_takes_the_redistribute_path():
    from torch.distributed.tensor import Replicate, Shard

    assert comm_path(_dtensor((1, 1), [Shard(0), Replicate()]), ALL_TO_ALL) == REDISTRIBUTE


@pytest.mark.usefixtures("one_rank_group")
def test_partial_dtensor_is_rejected():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.randn(4, 6), init_device_mesh("cpu", (1,)), [Partial()])
    with pytest.raises(ValueError, match="Partial"):
        comm_path(partial, ALL_TO_ALL)


@pytest.mark.usefixtures("one_rank_group")
def test_strided_shard_from_fsdp_plus_tp_takes_the_redistribute_path():
    """``_StridedShard`` subclasses ``Shard`` but reorders rows: not the fast path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = DTensor.from_local(torch.randn(4, 6), init_device_mesh("cpu", (1,)), [_StridedShard(0, split_factor=2)])
    assert comm_path(strided, ALL_TO_ALL) == REDISTRIBUTE
