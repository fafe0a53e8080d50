"""Every public answer of an owner plan on a few small layouts, as plain data: what
``tests/test_plan_answers.py`` compares with the answers the plan gave before it kept only
what one rank needs (``tests/data/plan_answers.json``, written by
``tests/data/make_plan_answers.py`` on commit 264f828). Public queries only, so the same
code reads the plan before and after."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon.plan import ParamSpec, lpt_bound_flops, make_owner_plan, scratch_events
from dmuon.plan.cost_model import CostModel, exchange_ms, newton_schulz_ms, optimizer_ms, plan_with_best_split
from dmuon.plan.layout import Layout
from dmuon.plan.local_blocks import LocalBlocks
from dmuon.plan.pack_layout import make_batch_layout

# Uneven shards, empty shards (3 rows over 4 ranks), a 3-D expert stack, a 4-D weight.
MIXED = [ParamSpec(s) for s in [(10, 6), (3, 5), (4, 2, 3), (7, 7), (16, 4), (2, 9), (4, 6, 3, 3)]]
COLUMNS = [ParamSpec((6, 10), shard_dim=1), ParamSpec((3, 8, 12), shard_dim=1), ParamSpec((3, 8, 12), shard_dim=2),
           ParamSpec((12, 8), split_rows=3)]
MESH = [
    ParamSpec((10, 6), layout=Layout.hsdp(2, 2)),
    ParamSpec((9, 7), layout=Layout((2, 2), (_StridedShard(0, split_factor=2), Shard(0)))),
    ParamSpec((6, 10), layout=Layout((2, 2), (Shard(0), Shard(1)))),
    ParamSpec((4, 6, 5), layout=Layout((2, 2), (Shard(1), Shard(0)))),
    ParamSpec((4, 3, 5), layout=Layout((2, 2), (Replicate(), Shard(0)))),
    ParamSpec((5, 8), layout=Layout((2, 2), (Replicate(), Shard(1)))),
    ParamSpec((4, 8, 8), layout=Layout((2, 2), (Replicate(), Shard(0)))),
]
# HSDP 2 x 3 with a head-split matrix, and a mesh whose positions hold the plan ranks out of order.
HSDP = [ParamSpec((12, 8), layout=Layout.hsdp(2, 3)), ParamSpec((12, 6), split_rows=6, layout=Layout.hsdp(2, 3)),
        ParamSpec((12, 6), split_rows=4, layout=Layout.hsdp(2, 3)), ParamSpec((7, 5), layout=Layout.hsdp(2, 3)),
        ParamSpec((2, 6, 4), layout=Layout.hsdp(2, 3))] + [ParamSpec((64, 64), layout=Layout.hsdp(2, 3))] * 3
SHUFFLED = [ParamSpec((12, 8), layout=Layout((2, 2), (Replicate(), Shard(0)), ranks=(3, 1, 2, 0))),
            ParamSpec((6, 9), layout=Layout((2, 2), (Replicate(), Shard(1)), ranks=(3, 1, 2, 0))),
            ParamSpec((8, 8), layout=Layout((4,), (Shard(0),), ranks=(2, 0, 3, 1)))]
# name -> (specs, world size, max_batch_numel, split_replicas)
CASES = {
    "mixed-P3": (MIXED, 3, 40, True),
    "mixed-P4": (MIXED, 4, 1 << 27, True),
    "columns-P4": (COLUMNS, 4, 60, True),
    "mesh-split": (MESH, 4, 50, True),
    "mesh-apart": (MESH, 4, 1 << 27, False),
    "hsdp-split": (HSDP, 6, 40, True),
    "hsdp-apart": (HSDP, 6, 40, False),
    "shuffled-split": (SHUFFLED, 4, 1 << 27, True),
    "shuffled-apart": (SHUFFLED, 4, 60, False),
}
# Cost models under which plan_with_best_split chooses (both ways on HSDP).
COSTS = {"default": CostModel(), "slow-ns": CostModel(ns_mfu=0.001), "slow-replicas": CostModel(replica_link_gbps=0.01)}


def _block(block) -> list | None:
    return None if block is None else [block.lo, block.hi, list(block.shape), list(block.offset)]


def _unit(unit, world_size: int) -> dict:
    return {
        "param": unit.param, "dim0": list(unit.dim0), "matrix": list(unit.matrix), "cost": unit.cost,
        "owner": unit.owner, "travels": unit.travels, "numel": unit.numel,
        "blocks": [[rank, _block(block)] for rank, block in unit.blocks], "holders": list(unit.holders),
        "candidates": list(unit.candidates), "sources": list(unit.sources),
        "sources_by_offset": list(unit.sources_by_offset), "rows_only": unit.rows_only,
        "even_rows": unit.even_rows(world_size),
        "by_rank": [[_block(unit.block(r)), unit.block_numel(r), unit.is_source(r),
                     [list(part) for part in unit.place(r)] if unit.block(r) else None] for r in range(world_size)],
    }


def _local_blocks(plan, rank: int) -> list:
    """Each parameter's blocks as ``LocalBlocks`` cuts a tensor of this rank's local shape
    (None where the rank holds none of it)."""
    blocks = LocalBlocks(plan, rank)
    out = []
    for j, spec in enumerate(plan.params):
        if not any(unit.param == j and unit.block(rank) for unit in plan.units):
            out.append(None)
            continue
        shape = tuple(n for _, n in spec.layout_on(plan.world_size).boxes(spec.shape)[rank])
        local = torch.arange(math.prod(shape)).view(shape)
        out.append([[list(t.shape), int(t.flatten()[0]) if t.numel() else None] for t in blocks.blocks_of(j, local)])
    return out


def plan_answers(plan) -> dict:
    """Every public query of ``plan``, for every rank and batch."""
    world = plan.world_size
    ranks = range(world)
    return {
        "units": [_unit(u, world) for u in plan.units],
        "batches": [list(b) for b in plan.batches],
        "per_batch": [{
            "travelling": plan.travelling(batch),
            "ranks": [{
                "gather": [list(part) for part in plan.gather_splits(batch, r)],
                "scatter": [list(part) for part in plan.scatter_splits(batch, r)],
                "kept_local": plan.kept_local(batch, r),
                "ns_flops": plan.ns_flops(r, batch),
                "layout": _jsonable(dataclasses.asdict(make_batch_layout(plan, batch, r))),
                "layout_keyed": _jsonable(dataclasses.asdict(make_batch_layout(plan, batch, r, lambda j: j % 2))),
            } for r in ranks],
        } for batch in plan.batches],
        "per_rank": [{
            "bytes_sent": plan.bytes_sent(r), "ns_flops": plan.ns_flops(r), "peak_scratch": plan.peak_scratch_bytes(r),
            "scratch_events": scratch_events(plan, r), "local_blocks": _local_blocks(plan, r),
        } for r in ranks],
        "ns_critical_path_flops": plan.ns_critical_path_flops,
        "lpt_bound_flops": lpt_bound_flops(plan),
        "costs": {name: {"exchange_ms": [list(part) for part in exchange_ms(plan, cost)],
                         "newton_schulz_ms": newton_schulz_ms(plan, cost), "optimizer_ms": optimizer_ms(plan, cost)}
                  for name, cost in COSTS.items()},
    }


def case_answers(name: str) -> dict:
    """The answers of case ``name``: its plan's, and which plan the cost model picks."""
    specs, world, max_batch_numel, split = CASES[name]
    answers = plan_answers(make_owner_plan(specs, world, max_batch_numel, split))
    answers["best_split"] = {cost_name: plan_with_best_split(specs, world, max_batch_numel, cost)[1]
                             for cost_name, cost in COSTS.items()}
    return answers


def _jsonable(value):
    """Tuples as lists, all the way down (what JSON gives back)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
