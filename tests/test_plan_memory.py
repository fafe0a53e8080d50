"""What one rank's optimizer keeps of its owner plan does not grow with units x P.

The heap (``tracemalloc``) a rank retains for a llama3-70b-like model's plan, as the fast
path makes and keeps it (one layout per parameter with its mesh's plan ranks, the plan,
this rank's ``LocalBlocks``, its buffer layout of every batch, its splits), at P = 64 and
P = 1024, under FSDP and HSDP (8 replicas, the ``split_replicas=None`` choice included).
Before the plan kept only what its rank needs it grew about 14x from 64 to 1024 ranks
(every unit kept a block per holder and the split memo every rank's splits)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dmuon.tools.dry_run.host_costs import retained_heap
from dmuon.plan import ParamSpec, make_owner_plan
from dmuon.plan import layout as layout_module
from dmuon.plan.cost_model import plan_with_best_split
from dmuon.plan.layout import Layout
from dmuon.plan.local_blocks import LocalBlocks
from dmuon.plan.pack_layout import make_batch_layout

pytestmark = pytest.mark.unit

# llama3-70b's Muon matrices: wq wk wv wo w1 w2 w3 (nn.Linear: out x in) of 80 layers.
DIM, FFN, KV, LAYERS = 8192, 28672, 8 * 128, 80
SHAPES = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (FFN, DIM), (DIM, FFN), (FFN, DIM)] * LAYERS
SMALL, LARGE = 64, 1024
HSDP_REPLICAS = 8
# The most the heap may grow from P = 64 to P = 1024 (16x the ranks).
MAX_GROWTH = 2.0
# A bound on the whole at P = 1024, far above what it keeps (under 1 MiB) and far below
# what it kept before (235 MiB under FSDP).
MAX_HEAP_BYTES = 8 << 20


def fsdp(world_size: int) -> Layout:
    return Layout.sharded(world_size)


def hsdp(world_size: int) -> Layout:
    return Layout.hsdp(HSDP_REPLICAS, world_size // HSDP_REPLICAS)


def kept_heap(mesh: Callable[[int], Layout], world_size: int, plan_with: Callable) -> int:
    """The heap a rank 0 retains for the plan, made as the fast path makes it: each
    parameter's own layout object (``dmuon.plan.paths.layout_of``), the plan, rank 0's
    local blocks, buffer layouts and splits. The box tables cached before are forgotten,
    so each figure counts its own."""
    layout_module._boxes.cache_clear()  # a private cache: each measurement makes its own box tables
    template = mesh(world_size)
    with retained_heap() as heap:
        specs = [ParamSpec(shape, layout=Layout(template.mesh_shape, template.placements, tuple(range(world_size))))
                 for shape in SHAPES]
        plan = plan_with(specs, world_size)
        del specs  # the fast path keeps the plan's, not its own
        kept = (plan, LocalBlocks(plan, 0), [make_batch_layout(plan, batch, 0) for batch in plan.batches],
                plan.peak_scratch_bytes(0), plan.bytes_sent(0))
    assert kept
    return heap[0]


def owner_plan(specs: list[ParamSpec], world_size: int):
    return make_owner_plan(specs, world_size)


def best_split(specs: list[ParamSpec], world_size: int):
    return plan_with_best_split(specs, world_size)[0]


@pytest.mark.parametrize(("mesh", "plan_with"), [(fsdp, owner_plan), (hsdp, best_split)], ids=["fsdp", "hsdp"])
def test_a_rank_s_plan_heap_barely_grows_from_64_to_1024_ranks(mesh, plan_with):
    small, large = kept_heap(mesh, SMALL, plan_with), kept_heap(mesh, LARGE, plan_with)
    assert large <= MAX_GROWTH * small, (small, large)
    assert large <= MAX_HEAP_BYTES, large


def test_a_plan_keeps_one_layout_object_per_distinct_layout():
    """The optimizer makes a layout per parameter, each holding P plan ranks: the plan
    keeps one of the equal ones."""
    specs = [ParamSpec((64, 64), layout=Layout.hsdp(2, 4)) for _ in range(3)]
    plan = make_owner_plan(specs, 8)
    assert len({id(spec.layout) for spec in plan.params}) == 1
    assert list(plan.params) == specs
