"""Which layouts keep int8 momentum's blocks whole on every rank (``dmuon.plan.momentum_blocks``,
issue 51; issue 60 items 4 and 5): decided from the placements and the global shape alone, so
every rank keeps a parameter's momentum in one form. Where the answer is no, that parameter's
momentum is kept in bf16 (``dmuon.state.kept_state.storage_of``)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

from dmuon.plan.layout import Layout
from dmuon.plan.momentum_blocks import int8_blocks_whole

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shape, layout, whole", [
    ((10, 300), Layout.sharded(4), True),  # FSDP: whole rows, uneven and empty shards
    ((3, 4, 200), Layout.sharded(4), True),  # an expert stack cut by experts
    ((3, 4, 200), Layout.sharded(2, dim=1), True),  # ... or by rows of each expert
    ((8, 256), Layout.sharded(2, dim=1), True),  # TP's column cut on a block boundary (128 a rank)
    ((8, 200), Layout.sharded(2, dim=1), False),  # ... off it (100 a rank)
    ((3, 4, 256), Layout.sharded(2, dim=2), True),  # a stack cut along its rows, on blocks
    ((3, 4, 200), Layout.sharded(2, dim=2), False),  # ... off them
    ((3, 4, 200), Layout((2, 2), (Replicate(), Shard(2))), False),
    ((64, 32, 3, 3), Layout.sharded(4), True),  # a 4-D weight's rows are [O, rest]'s: FSDP keeps them
    ((64, 32, 3, 3), Layout.sharded(2, dim=1), False),  # any cut inside [O, rest]
    ((64, 32, 3, 3), Layout.sharded(2, dim=3), False),
], ids=lambda v: str(v) if isinstance(v, (tuple, bool)) else f"{v.mesh_shape}{v.placements}")
def test_int8_blocks_stay_whole_exactly_where_no_rank_cuts_a_row_off_them(shape, layout, whole):
    assert int8_blocks_whole(layout, shape) == whole
