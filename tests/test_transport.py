"""The ways a matrix reaches Newton-Schulz (dmuon.exchange), each on its own.

The owner exchange's packing is specified in tests/test_comm_packing.py and its
exactness on every layout in tests/test_distributed_meshes.py. The local way only
calls Newton-Schulz on the rank's own update; the single-process and one-rank tests
(tests/test_optimizer_single_process.py, tests/test_distributed_exactness.py at
world size 1) cover it through the optimizer.
"""

from __future__ import annotations

import pytest

from tests import mesh_scenarios
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.multirank


# Every 2-D case of mesh_scenarios.MESH_CASES (the scenario leaves out the expert stacks).
MATRIX_CASES = {"hsdp.rows", "hsdp.tall", "hsdp.empty_shard", "fsdp_tp.colwise", "fsdp_tp.rowwise",
                "tp.rowwise", "tp.colwise"}


def test_the_reference_way_gives_each_rank_its_part_of_the_whole_result():
    equal = run_on_ranks(mesh_scenarios.reference_transport, 4)
    assert equal == [dict.fromkeys(MATRIX_CASES, True)] * 4
