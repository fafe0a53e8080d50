"""The ways a matrix reaches Newton-Schulz (dmuon.transport), each on its own.

The owner exchange's packing is specified in tests/test_comm_packing.py and its
exactness on every layout in tests/test_distributed_meshes.py.
"""

from __future__ import annotations

import torch

from dmuon.newton_schulz import orthogonalize
from dmuon.transport.local import orthogonalize_local
from tests import mesh_scenarios
from tests.multiprocess import run_on_ranks


def test_the_local_way_orthogonalizes_the_rank_s_own_update():
    update = torch.randn(6, 4).bfloat16()
    assert torch.equal(orthogonalize_local(update, update, orthogonalize), orthogonalize(update))


def test_the_reference_way_gives_each_rank_its_part_of_the_whole_result():
    equal = run_on_ranks(mesh_scenarios.reference_transport, 4)
    assert all(all(rank.values()) for rank in equal), equal[0]
