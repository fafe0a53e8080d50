"""Which block each rank holds (dmuon.plan.layout): DTensor's placement rules, as pure data."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon.plan.layout import Layout, as_box, chunk_ranges, local_indices

pytestmark = pytest.mark.unit


def test_chunks_follow_torch_chunk_with_short_and_empty_last_chunks():
    assert chunk_ranges(10, 4) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert chunk_ranges(3, 4) == [(0, 1), (1, 1), (2, 1), (3, 0)]


def _lengths(length: int, chunks: int) -> tuple[int, ...]:
    return tuple(n for _, n in chunk_ranges(length, chunks))


@pytest.mark.parametrize(
    "length, chunks, expected",
    [
        (8, 2, (4, 4)),
        (8, 4, (2, 2, 2, 2)),
        (10, 4, (3, 3, 3, 1)),
        (9, 4, (3, 3, 3, 0)),  # uneven and one empty chunk
        (5, 4, (2, 2, 1, 0)),
        (7, 1, (7,)),
    ],
)
def test_chunk_lengths_are_ceil_sized_with_the_last_ones_short_or_empty(length, chunks, expected):
    assert _lengths(length, chunks) == expected


@pytest.mark.parametrize("length, chunks", [(3, 4), (1, 8), (0, 3)])
def test_more_chunks_than_rows_gives_one_row_each_then_empty_chunks(length, chunks):
    assert _lengths(length, chunks) == (1,) * length + (0,) * (chunks - length)


def test_chunks_are_the_pieces_torch_chunk_cuts_as_dtensor_and_fsdp2_do():
    for chunks in range(1, 9):
        for length in range(0, 30):
            pieces = torch.arange(length).chunk(chunks) if length else ()
            expected = [(int(p[0]), len(p)) for p in pieces] + [(length, 0)] * (chunks - len(pieces))
            assert chunk_ranges(length, chunks) == expected, (length, chunks)


PLACEMENTS = {
    "fsdp": (Shard(0),),
    "tp_columns": (Shard(1),),
    "hsdp": (Replicate(), Shard(0)),
    "fsdp_over_tp_rows": (_StridedShard(0, split_factor=2), Shard(0)),
    "fsdp_over_tp_columns": (Shard(0), Shard(1)),
    "ep_then_fsdp_rows": (Shard(1), Shard(0)),
    "twice_on_dim_0": (Shard(0), Shard(0)),
}


def _fits(shape, mesh_shape, placements) -> bool:
    return len(placements) == len(mesh_shape) and all(p.dim < len(shape) for p in placements if not p.is_replicate())


BOX_CASES = [
    (shape, mesh_shape, name)
    for shape in [(10, 7), (7, 5), (16, 8), (3, 9), (5, 6, 7), (1, 4)]
    for mesh_shape in [(2,), (4,), (2, 2), (3, 2)]
    for name, placements in PLACEMENTS.items()
    if _fits(shape, mesh_shape, placements)
]


@pytest.mark.parametrize(("shape", "mesh_shape", "name"), BOX_CASES)
def test_every_rank_s_box_is_the_shape_and_offset_dtensor_computes(shape, mesh_shape, name):
    placements = PLACEMENTS[name]
    if isinstance(placements[0], _StridedShard):  # FSDP's split factor is the TP degree
        placements = (_StridedShard(0, split_factor=mesh_shape[1]), Shard(0))
    layout = Layout(mesh_shape, placements)
    for coordinate, (rank, box) in zip(layout.coordinates(), layout.boxes(shape).items()):
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
        assert box is not None
        assert tuple(length for _, length in box) == tuple(local_shape), (rank, box)
        assert [start for start, length in box if length] == [o for o, (_, n) in zip(offset, box) if n], (rank, box)


def test_fsdp_over_tp_holds_the_tp_shard_cut_by_fsdp():
    # TP first: tp rank t holds rows [5t, 5t + 5); FSDP then cuts those 5 rows into 3 + 2.
    layout = Layout((2, 2), (_StridedShard(0, split_factor=2), Shard(0)))
    rows = [box[0] for box in layout.boxes((10, 4)).values()]  # mesh order (fsdp, tp)
    assert rows == [(0, 3), (5, 3), (3, 2), (8, 2)]


def test_a_strided_shard_that_leaves_a_rank_two_ranges_is_not_a_box():
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    assert local_indices((13, 3), (3, 2), placements, (2, 0))[0] == [(6, 1), (11, 1)]
    assert Layout((3, 2), placements).boxes((13, 3))[4] is None


def test_replicas_are_the_coordinates_on_replicate_mesh_dims():
    layout = Layout.hsdp(2, 3)
    assert layout.replica() == {0: (0,), 1: (0,), 2: (0,), 3: (1,), 4: (1,), 5: (1,)}
    assert layout.boxes((6, 2))[1] == layout.boxes((6, 2))[4] == ((2, 2), (0, 2))


def test_plan_ranks_follow_the_mesh_positions_they_are_given():
    layout = Layout((2,), (Shard(0),), ranks=(5, 3))
    assert layout.boxes((4, 4)) == {5: ((0, 2), (0, 4)), 3: ((2, 2), (0, 4))}


@pytest.mark.parametrize("layout", [
    Layout.sharded(4), Layout.hsdp(2, 3), Layout((2, 2, 2), (Shard(0), Replicate(), Replicate())),
    Layout((2, 2), (Replicate(), Shard(1)), ranks=(3, 1, 2, 0)), Layout((2,), (Shard(0),), ranks=(5, 3)),
], ids=["fsdp", "hsdp", "two-replicate-dims", "shuffled", "other-ranks"])
def test_one_rank_s_facts_are_the_mesh_s_facts_of_that_rank(layout):
    """A plan asks about one rank at a time (its position, replica, box, elements of a
    range of rows) without keeping a per-rank map: the answers are the whole mesh's."""
    shape = (7, 6)
    boxes = layout.boxes(shape)
    replicas = layout.replica()
    assert list(boxes) == list(layout.mesh_ranks) == list(replicas)
    for position, rank in enumerate(layout.mesh_ranks):
        box = as_box(local_indices(shape, layout.mesh_shape, layout.placements, layout.coordinates()[position]))
        assert layout.position(rank) == position
        assert boxes[rank] == box
        assert layout.replica_of(rank) == replicas[rank]
        (start, rows), (_, cols) = box
        assert boxes.numel_at(position, (2, 5)) == max(0, min(start + rows, 5) - max(start, 2)) * cols
    assert layout.sorted_ranks == tuple(sorted(layout.mesh_ranks))
    assert sorted(layout.replica_keys()) == layout.replica_keys() == sorted(set(replicas.values()))
    for key in layout.replica_keys():
        assert layout.members(key) == tuple(sorted(r for r, k in replicas.items() if k == key))
        assert layout.members(key) is layout.members(key)  # one tuple per replica, shared
    outside = max(layout.mesh_ranks) + 1
    assert layout.replica_of(outside) is None and outside not in boxes and boxes.get(-1) is None
    with pytest.raises(KeyError):
        layout.position(outside)


def test_a_partial_placement_has_no_layout():
    with pytest.raises(ValueError, match="no layout"):
        local_indices((4, 4), (2,), (Partial(),), (0,))
