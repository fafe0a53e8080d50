"""Layer 2, the plan: everything decided from shapes, placements and world sizes, before
any tensor moves. Who owns which matrix, in which batch, which blocks travel where, what
it costs in bytes, flops and scratch memory. No process group, no collective: the plan of
any rank at any P can be made (and tested) in one process.

May import: ``dmuon.numerics`` (the flop counts of Newton-Schulz) and
``dmuon.torch_compat``. Imported by the exchange, QK-clip and the optimizer. Its modules
(one line each: docs/architecture.md, "Layers and files"): ``layout``, ``mesh_facts``,
``units``, ``cutting``, ``owners``, ``batches``, ``schedule``, ``owner_plan``, ``paths``,
``cost_model``, ``pack_layout``, ``local_blocks``, ``momentum_blocks``.

The names below are the plan's vocabulary, importable as ``dmuon.plan.<name>``.
"""

from dmuon.plan.batches import DEFAULT_BATCH_NUMEL, OVERLAP_BATCHES
from dmuon.plan.cutting import layout_problem, make_units
from dmuon.plan.owner_plan import WIRE_BYTES, OwnerPlan, lpt_bound_flops, make_owner_plan, scratch_events
from dmuon.plan.owners import assign_owners
from dmuon.plan.paths import ALL_TO_ALL, COMM_CHOICES, LOCAL, PATHS, REDISTRIBUTE, choose_paths, comm_path, layout_of
from dmuon.plan.schedule import (COLLECTIVE_EVENTS, FINISH_GATHER, FINISH_SCATTER, NEWTON_SCHULZ, START_GATHER,
                                 START_SCATTER, batch_schedule)
from dmuon.plan.units import Block, ParamSpec, Unit

__all__ = [
    "ALL_TO_ALL", "Block", "COLLECTIVE_EVENTS", "COMM_CHOICES", "DEFAULT_BATCH_NUMEL", "FINISH_GATHER",
    "FINISH_SCATTER", "LOCAL", "NEWTON_SCHULZ", "OVERLAP_BATCHES", "OwnerPlan", "PATHS", "ParamSpec", "REDISTRIBUTE",
    "START_GATHER", "START_SCATTER", "Unit", "WIRE_BYTES", "assign_owners", "batch_schedule", "choose_paths",
    "comm_path", "layout_of", "layout_problem", "lpt_bound_flops", "make_owner_plan", "make_units", "scratch_events",
]
