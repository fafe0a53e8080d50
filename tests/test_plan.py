"""Owner and batch planning (dmuon.plan): pure functions of shapes, placements and world sizes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon.numerics.newton_schulz import newton_schulz_flops
from dmuon.plan import (
    ALL_TO_ALL,
    FINISH_GATHER,
    FINISH_SCATTER,
    LOCAL,
    NEWTON_SCHULZ,
    REDISTRIBUTE,
    START_GATHER,
    START_SCATTER,
    ParamSpec,
    assign_owners,
    batch_schedule,
    comm_path,
    layout_problem,
    lpt_bound_flops,
    make_owner_plan,
    make_units,
    scratch_events,
)
from dmuon.plan.batches import OVERLAP_BATCHES
from dmuon.plan.layout import Layout, chunk_ranges

pytestmark = pytest.mark.unit

# ------------------------------------------------------------------ assign_owners


def test_assign_owners_is_deterministic():
    costs = [7, 3, 9, 3, 1, 8, 8, 2]
    assert assign_owners(costs, 3) == assign_owners(tuple(costs), 3) == assign_owners(list(costs), 3)


def test_assign_owners_is_longest_processing_time_first():
    # 5 -> r0, 4 -> r1, 3 -> r1 (4 < 5), 3 -> r0 (5 < 7), 3 -> r1 (7 < 8)
    assert assign_owners([5, 4, 3, 3, 3], 2) == (0, 1, 1, 0, 1)


def test_assign_owners_starts_from_the_loads_ranks_already_carry():
    assert assign_owners([4, 4], 2, loads=[10, 0]) == (1, 1)


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


# ------------------------------------------------------------------ units and blocks

# Uneven shards, empty shards (3 rows over 4 ranks) and a 3-D expert stack.
MIXED_SHAPES = [(10, 6), (3, 5), (4, 2, 3), (7, 7), (16, 4), (2, 9)]


def _llama_like(layers: int, dim: int, hidden: int) -> list[tuple[int, int]]:
    per_layer = [(dim, dim)] * 4 + [(hidden, dim), (dim, hidden), (hidden, dim)]  # wq wk wv wo w1 w2 w3
    return per_layer * layers


def _blocks(unit):
    """Each rank's block as ``(local dim-0 slice, shape, offset in the matrix)``."""
    return {r: ((b.lo, b.hi), b.shape, b.offset) for r, b in unit.blocks}


def test_a_2d_parameter_is_one_unit_whose_blocks_are_its_row_shards():
    (unit,) = make_units([ParamSpec((10, 6))], 4)
    assert unit.matrix == (10, 6) and unit.travels
    assert [b.shape[0] for _, b in unit.blocks] == [3, 3, 3, 1]  # torch.chunk's rows
    assert [b.offset for _, b in unit.blocks] == [(0, 0), (3, 0), (6, 0), (9, 0)]


def test_a_column_sharded_2d_parameter_has_column_blocks():
    (unit,) = make_units([ParamSpec((6, 10), shard_dim=1)], 4)
    assert _blocks(unit)[3] == ((0, 6), (6, 1), (0, 9))
    assert [b.offset[1] for _, b in unit.blocks] == [0, 3, 6, 9]


def test_a_rank_with_an_empty_shard_holds_no_block():
    (unit,) = make_units([ParamSpec((3, 5))], 4)
    assert unit.holders == (0, 1, 2) and unit.block(3) is None


def test_a_3d_stack_is_one_unit_per_expert():
    units = make_units([ParamSpec((4, 2, 3))], 2)
    assert [u.dim0 for u in units] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert all(u.matrix == (2, 3) for u in units)
    assert all(u.cost == newton_schulz_flops((2, 3), 5) for u in units)


def test_experts_sharded_on_dim_0_are_whole_on_one_rank_and_do_not_travel():
    units = make_units([ParamSpec((4, 2, 3))], 2)
    assert [u.holders for u in units] == [(0,), (0,), (1,), (1,)]
    assert [_blocks(u)[u.holders[0]][0] for u in units] == [(0, 1), (1, 2), (0, 1), (1, 2)]
    assert not any(u.travels for u in units)


@pytest.mark.parametrize("shard_dim", [1, 2])
def test_experts_sharded_inside_the_matrix_travel_as_blocks(shard_dim):
    units = make_units([ParamSpec((3, 8, 12), shard_dim=shard_dim)], 4)
    assert len(units) == 3 and all(u.travels and len(u.blocks) == 4 for u in units)
    cut = shard_dim - 1  # dim 1 cuts an expert's rows, dim 2 its columns
    assert [b.shape[cut] for _, b in units[0].blocks] == [n for _, n in chunk_ranges((8, 12)[cut], 4)]


def test_a_4d_parameter_sharded_past_dim_0_has_no_block_layout():
    assert layout_problem((4, 6, 3, 3), Layout.sharded(2, 0)) is None
    assert "4-D" in layout_problem((4, 6, 3, 3), Layout.sharded(2, 1))
    with pytest.raises(ValueError, match="4-D"):
        make_units([ParamSpec((4, 6, 3, 3), shard_dim=1)], 2)


def test_blocks_locate_each_rank_s_part_in_its_own_shard():
    plan = make_owner_plan([ParamSpec((10, 6)), ParamSpec((4, 2, 3)), ParamSpec((6, 10), shard_dim=1)], 4)
    row_unit, *experts, col_unit = plan.units
    assert [_blocks(row_unit)[r][0] for r in range(4)] == [(0, 3), (0, 3), (0, 3), (0, 1)]
    assert _blocks(experts[2]) == {2: ((0, 1), (2, 3), (0, 0))}
    assert [_blocks(col_unit)[r][0] for r in range(4)] == [(0, 6)] * 4


# ------------------------------------------------------------------ several mesh dims


def test_fsdp_over_tp_blocks_are_tp_first_then_fsdp_shards():
    # (fsdp, tp) = (_StridedShard(0, 2), Shard(0)): tp rank t holds rows t*N/2.., fsdp cuts that.
    layout = Layout((2, 2), (_StridedShard(0, split_factor=2), Shard(0)))
    (unit,) = make_units([ParamSpec((8, 4), layout=layout)], 4)
    assert [b.offset[0] for _, b in unit.blocks] == [0, 4, 2, 6]  # mesh order (f, t): 00 01 10 11


def test_every_hsdp_replica_holds_every_block_and_receives_the_result():
    plan = make_owner_plan([ParamSpec((8, 4), layout=Layout.hsdp(2, 2))], 4, split_replicas=True)
    (unit,) = plan.units
    assert unit.holders == (0, 1, 2, 3)
    assert len(unit.sources) == 2 and unit.owner in unit.sources  # one replica sends: the owner's
    assert sum(sum(plan.scatter_splits(plan.batches[0], r)[1]) for r in range(4)) == 2 * 32


def test_split_replicas_spreads_newton_schulz_over_every_rank():
    shapes = [(16, 16)] * 8
    split = make_owner_plan([ParamSpec(s, layout=Layout.hsdp(2, 2)) for s in shapes], 4, split_replicas=True)
    apart = make_owner_plan([ParamSpec(s, layout=Layout.hsdp(2, 2)) for s in shapes], 4, split_replicas=False)
    total = 8 * newton_schulz_flops((16, 16), 5)
    assert [split.ns_flops(r) for r in range(4)] == [total // 4] * 4
    assert [apart.ns_flops(r) for r in range(4)] == [total // 2] * 4  # every replica does everything
    # Apart, nothing crosses replicas: ranks 0, 1 and ranks 2, 3 only talk among themselves.
    for batch in apart.batches:
        for rank in range(4):
            for send in (apart.gather_splits(batch, rank)[0], apart.scatter_splits(batch, rank)[0]):
                assert [n for peer, n in enumerate(send) if peer // 2 != rank // 2] == [0, 0]


def test_a_replicated_expert_held_whole_is_orthogonalized_by_each_holder_in_place():
    # (dp_replicate, ep) = (Replicate(), Shard(0)): each expert whole on one rank per replica.
    layout = Layout((2, 2), (Replicate(), Shard(0)))
    plan = make_owner_plan([ParamSpec((4, 8, 8), layout=layout)], 4)
    assert len(plan.units) == 8 and not any(u.travels for u in plan.units)
    assert all(plan.bytes_sent(r) == 0 for r in range(4))


# ------------------------------------------------------------------ owners and batches


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("max_batch_numel", [40, 1 << 27])
def test_gather_splits_agree_between_senders_and_owners(world_size, max_batch_numel):
    """What rank r sends to owner o is exactly what o expects to receive from r."""
    plan = make_owner_plan(MIXED_SHAPES, world_size, max_batch_numel=max_batch_numel)
    for batch in plan.batches:
        splits = [plan.gather_splits(batch, rank) for rank in range(world_size)]
        for sender in range(world_size):
            for owner in range(world_size):
                assert splits[sender][0][owner] == splits[owner][1][sender], (batch, sender, owner)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_splits_deliver_every_travelling_element_once(world_size):
    plan = make_owner_plan(MIXED_SHAPES, world_size, max_batch_numel=40)
    for batch in plan.batches:
        sent = sum(sum(plan.gather_splits(batch, rank)[0]) for rank in range(world_size))
        received_by_owner = [sum(plan.gather_splits(batch, rank)[1]) for rank in range(world_size)]
        travelling = plan.travelling(batch)
        owned_numel = [sum(plan.units[i].numel for i in travelling if plan.units[i].owner == r) for r in range(world_size)]
        assert received_by_owner == owned_numel
        assert sent == sum(plan.units[i].numel for i in travelling)


def test_every_unit_is_in_exactly_one_batch():
    plan = make_owner_plan(MIXED_SHAPES * 3, 3, max_batch_numel=40)
    indices = [i for batch in plan.batches for i in batch]
    assert sorted(indices) == list(range(len(plan.units)))


def test_owners_are_a_whole_step_lpt_assignment_of_the_travelling_units():
    shapes = _llama_like(layers=4, dim=64, hidden=160)
    plan = make_owner_plan(shapes, 3, max_batch_numel=1)  # many batches: owners must not depend on them
    costs = [u.cost for u in plan.units]
    assert tuple(u.owner for u in plan.units) == assign_owners(costs, 3)


def test_units_held_whole_by_one_rank_are_owned_there():
    plan = make_owner_plan([ParamSpec((4, 8, 8)), (8, 8)], 2)
    assert [u.owner for u in plan.units[:4]] == [0, 0, 1, 1]


def test_whole_experts_cost_nothing_on_the_wire():
    plan = make_owner_plan([ParamSpec((6, 16, 16))], 3)
    assert all(plan.bytes_sent(rank) == 0 for rank in range(3))
    assert all(plan.ns_flops(rank) == 2 * newton_schulz_flops((16, 16), 5) for rank in range(3))


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_rank_has_work_in_every_batch_when_it_owns_enough_units(world_size):
    shapes = _llama_like(layers=8, dim=64, hidden=160)
    plan = make_owner_plan(shapes, world_size, max_batch_numel=64 * 160)
    assert len(plan.batches) > 1
    for batch in plan.batches:
        assert all(plan.ns_flops(rank, batch) > 0 for rank in range(world_size)), batch


@pytest.mark.parametrize("cap", [1, 64 * 64, 2 * 64 * 160])
def test_a_rank_owns_at_most_the_cap_or_the_batch_s_tallest_matrix_per_batch(cap):
    shapes = _llama_like(layers=4, dim=64, hidden=160)
    plan = make_owner_plan(shapes, 2, max_batch_numel=cap)
    for batch in plan.batches:
        tallest = max((plan.units[i] for i in batch), key=lambda u: u.cost)
        for rank in range(2):
            owned = [plan.units[i].numel for i in plan.travelling(batch) if plan.units[i].owner == rank]
            assert sum(owned) <= max(cap, tallest.numel)


def test_a_cap_below_every_matrix_gives_one_matrix_per_rank_per_batch():
    plan = make_owner_plan(_llama_like(layers=2, dim=64, hidden=160), 2, max_batch_numel=1)
    # 14 matrices, 7 owned by each rank: 7 batches, each one matrix of rank 0's and one of rank 1's.
    assert [sorted(plan.units[i].owner for i in batch) for batch in plan.batches] == [[0, 1]] * 7


def test_a_matrix_larger_than_the_cap_forms_a_batch_of_its_own_on_its_owner():
    plan = make_owner_plan([(8, 8), (64, 64), (8, 8)], 2, max_batch_numel=10)
    big = next(b for b, batch in enumerate(plan.batches) if 1 in batch)
    owner = plan.units[1].owner
    assert [i for i in plan.batches[big] if plan.units[i].owner == owner] == [1]


def test_a_last_batch_far_shorter_than_the_others_joins_the_one_before_it():
    # llama3's proportions with GQA (keys and values a quarter wide): the key and value
    # matrices are a sliver of the work, and left alone they would make a fifth batch.
    kv = 8
    per_layer = [(32, 32), (kv, 32), (kv, 32), (32, 32), (112, 32), (32, 112), (112, 32)]
    plan = make_owner_plan(per_layer * 32, 2)
    heights = [max(plan.ns_flops(rank, batch) for rank in range(2)) for batch in plan.batches]
    assert len(plan.batches) == OVERLAP_BATCHES
    assert min(heights) > max(heights) / OVERLAP_BATCHES


def test_critical_path_stays_at_the_lpt_bound_when_batches_follow_shelves():
    shapes = _llama_like(layers=8, dim=64, hidden=160)
    for world_size in (2, 4, 8, 16):
        plan = make_owner_plan(shapes, world_size, max_batch_numel=64 * 160)
        assert plan.ns_critical_path_flops <= 1.1 * lpt_bound_flops(plan), world_size


def test_more_ranks_than_matrices_leaves_the_extra_ranks_without_newton_schulz():
    plan = make_owner_plan([(8, 8), (8, 8)], 4)
    assert sorted(u.owner for u in plan.units) == [0, 1]
    assert plan.ns_flops(2) == plan.ns_flops(3) == 0


# ------------------------------------------------------------------ bytes and memory


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_is_a_pth_of_an_all_gather_for_a_balanced_stack(world_size):
    """4 * N * (P - 1) / P^2 bytes per rank: bf16 rows to owners and back, 1/P of an all-gather."""
    shapes = _llama_like(layers=4, dim=64, hidden=128)
    total = sum(rows * cols for rows, cols in shapes)
    plan = make_owner_plan(shapes, world_size)
    expected = 4 * total * (world_size - 1) // world_size**2
    assert 4 * total * (world_size - 1) % world_size**2 == 0
    for rank in range(world_size):
        assert plan.bytes_sent(rank) == expected


def test_bytes_sent_counts_element_size():
    plan = make_owner_plan(_llama_like(2, 32, 64), 2)
    assert plan.bytes_sent(0, element_size=4) == 2 * plan.bytes_sent(0, element_size=2)


def test_bytes_sent_on_one_rank_is_zero():
    plan = make_owner_plan(MIXED_SHAPES, 1)
    assert plan.bytes_sent(0) == 0
    assert {u.owner for u in plan.units} == {0}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_scratch_events_free_everything_they_allocate(world_size):
    plan = make_owner_plan(MIXED_SHAPES * 2, world_size, max_batch_numel=40)
    for rank in range(world_size):
        assert sum(scratch_events(plan, rank)) == 0


def test_peak_scratch_is_bounded_by_three_batches_of_buffers():
    """The documented bound: 2 bytes x (two full copies of a batch's owned matrices,
    plus send and receive buffers of the batches before and after it, plus one block)."""
    plan = make_owner_plan(_llama_like(layers=6, dim=64, hidden=160), 4, max_batch_numel=64 * 160)
    for rank in range(4):
        per_batch = []
        for batch in plan.batches:
            send, recv = plan.gather_splits(batch, rank)
            per_batch.append(sum(send) + sum(recv))
        owned_max = max(sum(plan.gather_splits(b, rank)[1]) for b in plan.batches)
        bound = 2 * (2 * owned_max + 2 * max(per_batch) + max(u.numel for u in plan.units))
        assert 0 < plan.peak_scratch_bytes(rank) <= bound


def test_smaller_batches_need_less_scratch():
    shapes = _llama_like(layers=8, dim=64, hidden=160)
    big = make_owner_plan(shapes, 2)
    small = make_owner_plan(shapes, 2, max_batch_numel=64 * 160)
    assert len(small.batches) > len(big.batches)
    assert small.peak_scratch_bytes(0) < big.peak_scratch_bytes(0)


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
def test_any_placement_on_a_one_rank_mesh_takes_the_local_path():
    from torch.distributed.tensor import Replicate, Shard

    assert comm_path(_dtensor((1,), [Shard(1)]), ALL_TO_ALL) == LOCAL
    assert comm_path(_dtensor((1, 1), [Shard(0), Replicate()]), ALL_TO_ALL) == LOCAL


@pytest.mark.usefixtures("one_rank_group")
def test_partial_dtensor_is_rejected():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.randn(4, 6), init_device_mesh("cpu", (1,)), [Partial()])
    with pytest.raises(ValueError, match="Partial"):
        comm_path(partial, ALL_TO_ALL)


# ------------------------------------------------------------------ batch_schedule


def test_the_batch_schedule_of_three_batches_overlaps_each_newton_schulz_with_two_collectives():
    G0, G1, G2 = ((START_GATHER, b) for b in range(3))
    assert batch_schedule(3) == (
        G0,
        (FINISH_GATHER, 0), G1, (NEWTON_SCHULZ, 0), (START_SCATTER, 0),
        (FINISH_GATHER, 1), G2, (NEWTON_SCHULZ, 1), (START_SCATTER, 1), (FINISH_SCATTER, 0),
        (FINISH_GATHER, 2), (NEWTON_SCHULZ, 2), (START_SCATTER, 2), (FINISH_SCATTER, 1),
        (FINISH_SCATTER, 2),
    )


def test_no_batches_schedule_nothing():
    assert batch_schedule(0) == ()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_the_batch_schedule_runs_every_event_once_in_a_workable_order(n):
    schedule = batch_schedule(n)
    position = {event: i for i, event in enumerate(schedule)}
    assert len(position) == len(schedule) == 5 * n
    for b in range(n):
        assert position[(START_GATHER, b)] < position[(FINISH_GATHER, b)] < position[(NEWTON_SCHULZ, b)]
        assert position[(NEWTON_SCHULZ, b)] < position[(START_SCATTER, b)] < position[(FINISH_SCATTER, b)]
        if b + 1 < n:  # gather b + 1 and scatter b - 1 travel while batch b orthogonalizes
            assert position[(START_GATHER, b + 1)] < position[(NEWTON_SCHULZ, b)] < position[(FINISH_GATHER, b + 1)]
        if b:
            assert position[(START_SCATTER, b - 1)] < position[(NEWTON_SCHULZ, b)] < position[(FINISH_SCATTER, b - 1)]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_the_batch_schedule_keeps_at_most_three_batches_alive(n):
    alive: set[int] = set()
    most = 0
    for event, b in batch_schedule(n):
        if event == START_GATHER:
            alive.add(b)
        elif event == FINISH_SCATTER:
            alive.discard(b)
        most = max(most, len(alive))
    assert not alive and most == min(n, 3)


@pytest.mark.parametrize("algorithm", ["standard", "gram", "auto"])
def test_each_unit_costs_the_flops_of_its_groups_ns_algorithm(algorithm):
    specs = [ParamSpec((64, 64), ns_algorithm=algorithm), ParamSpec((256, 64), ns_algorithm=algorithm),
             ParamSpec((2, 32, 96), ns_algorithm=algorithm)]
    plan = make_owner_plan(specs, 2)
    assert sorted(u.cost for u in plan.units) == sorted(
        [newton_schulz_flops((64, 64), 5, algorithm), newton_schulz_flops((256, 64), 5, algorithm)]
        + 2 * [newton_schulz_flops((32, 96), 5, algorithm)])
