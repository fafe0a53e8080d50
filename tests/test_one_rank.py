"""At P = 1 every DTensor parameter is whole on its one rank: DMuon steps it with the
bits of a single process, on the local path with the default ``comm="all_to_all"``
(there is no one to exchange with) and on the reference path (a one-rank
``redistribute``) with ``comm="redistribute"``.

The scenarios of the multi-rank exactness tests (``tests/distributed_scenarios.py``;
``test_distributed_exactness.py`` and ``test_distributed_scale_out.py`` run them at
P = 2 and 4), run here in this process on a one-rank gloo group: the base cases in both
compute dtypes (``comm`` all_to_all and redistribute), NorMuon with cautious weight decay
(split_rows included), Gram Newton-Schulz, and the block layouts and attention heads of
the scale-out tests. A DTensor without a grad keeps its bits on the local path, under the
step's mask made on the host or on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dmuon import DMuon
from tests import distributed_scenarios as scenarios

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_gloo", "one_thread")]

LAYOUT_CASES = [name for name, _, _ in scenarios.LAYOUT_CASES]
HEAD_CASES = [name for name, _, _ in scenarios.HEAD_CASES]
DEFAULT_CAP = 1 << 27


# The path a Shard(0) matrix takes on one rank, per ``comm``.
ONE_RANK_PATH = {"all_to_all": "local", "redistribute": "redistribute"}
Figures = tuple[dict[str, bool], dict[str, set[str]]]


def _exactness_figures(figures: dict[Any, Any]) -> Figures:
    """``(flags, paths)`` of an exactness scenario: every bitwise-equality flag, per run
    and case, and per ``comm`` every path its runs took."""
    flags: dict[str, bool] = {}
    paths: dict[str, set[str]] = {}
    for key, value in figures.items():
        if len(key) == 2 or key[-1] == "moments":  # (layout, comm), ("split_rows", comm), NorMuon state
            flags.update({f"{key}: {case}": ok for case, ok in value.items()})
        elif key[-1] == "paths":
            paths.setdefault(key[1], set()).update(value.values())
    return flags, paths


def _layout_figures(figures: dict[str, Any]) -> Figures:
    """The same of a layout scenario (``comm`` left at its default, all_to_all)."""
    return figures["equal"], {"all_to_all": set(figures["paths"].values())}


SCENARIOS: dict[str, Callable[[], Figures]] = {
    **{f"base_{dtype}": lambda dtype=dtype: _exactness_figures(scenarios.exactness(dtype))
       for dtype in scenarios.NS_DTYPES},
    **{f"normuon_{dtype}": lambda dtype=dtype: _exactness_figures(scenarios.variants_exactness(dtype))
       for dtype in scenarios.NS_DTYPES},
    "gram": lambda: _exactness_figures(scenarios.exactness("float32", "gram")),
    **{f"block_layouts_{dtype}": lambda dtype=dtype: _layout_figures(
        scenarios.layout_exactness(LAYOUT_CASES, DEFAULT_CAP, ns_dtype=dtype)) for dtype in scenarios.NS_DTYPES},
    **{f"heads_{algorithm}": lambda algorithm=algorithm: _layout_figures(
        scenarios.layout_exactness(HEAD_CASES, DEFAULT_CAP, 4, ns_algorithm=algorithm))
       for algorithm in ("standard", "gram")},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_one_rank_steps_the_bits_of_a_single_process_on_the_local_path_or_the_one_comm_asks_for(scenario):
    flags, paths = SCENARIOS[scenario]()
    assert flags and [k for k, ok in flags.items() if not ok] == []
    assert paths and paths == {comm: {ONE_RANK_PATH[comm]} for comm in paths}


# ------------------------------------------------------------- a parameter without a grad


@pytest.mark.parametrize("placement", ["shard", "replicate"])
@pytest.mark.parametrize("skip_nonfinite", [False, True], ids=["mask_on_the_host", "mask_on_the_device"])
def test_a_dtensor_without_a_grad_on_the_local_path_keeps_its_bits_under_weight_decay(placement, skip_nonfinite):
    # Its own "no grad here" mask, not the step's: neither decayed nor stepped (issue 67, item 5).
    # skip_nonfinite leaves the step's mask to the device, which the local path then reads.
    mesh = init_device_mesh("cpu", (1,))
    placements = [Shard(0) if placement == "shard" else Replicate()]
    generator = torch.Generator().manual_seed(0)

    def dtensor(*shape: int) -> torch.Tensor:
        return distribute_tensor(torch.randn(shape, generator=generator), mesh, placements)

    stepped, idle = nn.Parameter(dtensor(16, 24)), nn.Parameter(dtensor(12, 20))
    optimizer = DMuon([("stepped", stepped), ("idle", idle)], lr=0.05, weight_decay=0.1,
                      skip_nonfinite=skip_nonfinite)
    before, stepped_before = idle.detach().to_local().clone(), stepped.detach().to_local().clone()
    for _ in range(2):
        stepped.grad = dtensor(16, 24)
        optimizer.step()
    assert optimizer.comm_paths() == {"stepped": "local", "idle": "local"}
    assert not torch.equal(stepped.detach().to_local(), stepped_before)
    assert torch.equal(idle.detach().to_local(), before) and idle not in optimizer.state
