"""One ``DMuon``'s fast path: its owner plan, its process group, its step
(``dmuon.exchange.owner_exchange``).

NorMuon normalizes on the owner, where the matrix is whole, from its replica of the per-row
state (``dmuon.numerics.update_rules.normuon_state``); after the exchange
``dmuon.exchange.reductions.share_second_moments`` gives every rank the rows the owners wrote.
Made lazily: the paths (``dmuon.plan.paths``) on first query, the plan at the first ``step()``;
adding a param group forgets both. Every step runs every unit of the plan, whatever the grads (a
parameter without a usable grad here sends its momentum); the device mask of
``dmuon.exchange.grad_status`` decides, on every rank alike, which results are applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dmuon.exchange.comm import CommStats, ScratchMeter, mesh_device
from dmuon.exchange.groups import group_of
from dmuon.exchange.host_staging import HostStaging, check_offload, staging_for
from dmuon.exchange.owner_exchange import Callbacks, run_owner_plan
from dmuon.exchange.reductions import share_second_moments
from dmuon.step.group_steps import GroupSteps, by_group
from dmuon.step.converted_momenta import ConvertedMomenta
from dmuon.state.kept_state import kept_momentum
from dmuon.numerics.masked_updates import mask_
from dmuon.numerics.newton_schulz import resolve_ns_algorithm, resolve_ns_dtype
from dmuon.numerics.standard_iteration import NewtonSchulzBuffers
from dmuon.numerics.update_rules import compute_copy
from dmuon.plan.cost_model import CostModel, plan_with_best_split
from dmuon.plan.local_blocks import LocalBlocks
from dmuon.plan.mesh_facts import mesh_ranks
from dmuon.plan.owner_plan import OwnerPlan, make_owner_plan
from dmuon.plan.pack_layout import BatchLayout, make_batch_layout
from dmuon.plan.paths import ALL_TO_ALL, PATHS, choose_paths, layout_of
from dmuon.plan.units import ParamSpec, Unit
from dmuon.torch_compat import compute_local_shape_and_global_offset, host_tensor_ops, local_of

logger = logging.getLogger("dmuon")

@dataclass
class OwnerRun:
    """The fast-path Muon parameters, their owner plan, and the ranks that run it: what is
    made once per plan (a step's own tensors are :class:`FastStep`'s)."""

    group: dist.ProcessGroup  # every rank of the parameters' meshes (plan rank = rank in this group)
    rank: int
    params: list[DTensor]
    plan: OwnerPlan
    device: torch.device  # where this rank's buffers live (the meshes' device)
    blocks: LocalBlocks = field(init=False)  # this rank's blocks of the plan's units (views kept with the plan)
    layouts: dict[tuple[int, ...], BatchLayout] = field(default_factory=dict)  # each batch's, made at first use
    dtypes: list[torch.dtype] = field(init=False)  # read once: a DTensor attribute costs microseconds
    shared_dtype: torch.dtype | None = field(init=False)  # the parameters' one dtype, or None
    wrong_shards: list[int] = field(default_factory=list)
    """Plan parameters whose local shard here is not the block the plan assumes; each has a
    stand-in, zeros of the plan's shape (the step is then masked everywhere, same collectives)."""
    stand_ins: dict[int, torch.Tensor] = field(default_factory=dict)
    staging: HostStaging | None = None  # FSDP2's CPU offload: dmuon.exchange.host_staging
    _unpacked: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.blocks = LocalBlocks(self.plan, self.rank)
        self.dtypes = [p.dtype for p in self.params]
        self.shared_dtype = self.dtypes[0] if len(set(self.dtypes)) == 1 else None

    def layout(self, batch: tuple[int, ...]) -> BatchLayout:
        """The layout of ``batch``, made once (blocks of each dtype packed by their own ops)."""
        if batch not in self.layouts:
            self.layouts[batch] = make_batch_layout(self.plan, batch, self.rank, lambda j: self.dtypes[j])
        return self.layouts[batch]

    def widen(self, recv: torch.Tensor) -> torch.Tensor:
        """Results in the parameters' dtype (one cast of the receive buffer) on an accelerator,
        whose multi-tensor kernel wants one dtype; the same bits (a bf16 value widens exactly)."""
        if recv.device.type == "cpu" or self.shared_dtype in (None, recv.dtype):
            return recv
        return recv.to(self.shared_dtype)

    def unpacked_units(self) -> list[int]:
        """Units this rank holds a block of but never packs (a replica's blocks outside its
        owner's replica: they only receive), whose momentum still takes its EMA. Made once."""
        if self._unpacked is None:
            packed = set()
            for batch in self.plan.batches:
                packed.update(self.layout(batch).send_units)
                packed.update(self.plan.kept_local(batch, self.rank))
            self._unpacked = [i for i, unit in enumerate(self.plan.units)
                              if i not in packed and unit.block_numel(self.rank) > 0]
        return self._unpacked

    def local(self, j: int, tensor: torch.Tensor) -> torch.Tensor:
        """The local tensor of ``tensor`` (a grad or state of plan parameter ``j``), or
        the stand-in."""
        return self.stand_ins.get(j, local_of(tensor))


class FastPath:
    """One optimizer's paths, and its one owner plan with the group that runs it (a parameter on
    a mesh of other ranks takes the reference path, ``dmuon.plan.paths``)."""

    def __init__(self, comm: str, max_batch_numel: int, split_replicas: bool | None, ns_dtype: str,
                 link_gbps: float, replica_link_gbps: float) -> None:
        self.comm, self.max_batch_numel, self.split_replicas = comm, max_batch_numel, split_replicas
        self.ns_dtype, self.link_gbps, self.replica_link_gbps = ns_dtype, link_gbps, replica_link_gbps
        self.forget()

    def forget(self) -> None:
        """Drop the paths and the plan: the Muon parameters changed."""
        self._paths: dict[torch.Tensor, str] | None = None
        self.owner_run: OwnerRun | None = None  # the owner plan with its group and this rank's blocks, once made
        self._planned = False

    def paths(self, muon_params: Sequence[torch.Tensor], name_of: Callable[[torch.Tensor], str]
              ) -> dict[torch.Tensor, str]:
        """Each Muon parameter's path (``dmuon.plan.paths``; no collective), made once."""
        if self._paths is None:
            self._paths = choose_paths(muon_params, self.comm, name_of)
        return self._paths

    def plan(self, groups_of: Mapping[torch.Tensor, dict[str, Any]], name_of: Callable[[torch.Tensor], str]) -> None:
        """Plan the fast path once, at the first step (``groups_of``: each Muon parameter's
        group). No collective."""
        if self._planned:
            return
        paths = self.paths(list(groups_of), name_of)
        check_offload(paths, ALL_TO_ALL, name_of)
        fast = [p for p, path in paths.items() if path == ALL_TO_ALL]
        if fast:
            run = self._make_run(fast, [groups_of[p] for p in fast])
            self._check_shards_agree_with_plan(run)
            self.owner_run = run
        self._planned = True
        for path in PATHS:
            names = [name_of(p) for p, chosen in paths.items() if chosen == path]
            if names:
                logger.info("DMuon: %d Muon parameter(s) use the %s path: %s", len(names), path, ", ".join(names))

    def cost_model(self, device_type: str) -> CostModel:
        """What the ``split_replicas=None`` choice assumes: this optimizer's network and
        Newton-Schulz dtype."""
        return CostModel(ns_dtype=resolve_ns_dtype(self.ns_dtype, device_type), link_gbps=self.link_gbps,
                         replica_link_gbps=self.replica_link_gbps)

    def _make_run(self, params: list[DTensor], groups: list[dict[str, Any]]) -> OwnerRun:
        ranks = mesh_ranks(params[0].device_mesh)
        group = group_of(ranks, [p.device_mesh for p in params])
        plan_rank = {r: dist.get_group_rank(group, r) for r in ranks}
        device = mesh_device(params[0].device_mesh)
        dtype = resolve_ns_dtype(self.ns_dtype, device.type)
        specs = [ParamSpec(tuple(p.shape), ns_steps=g["ns_steps"], split_rows=g["split_rows"],
                           ns_algorithm=resolve_ns_algorithm(g["ns_algorithm"], dtype, device.type),
                           ns_gram_restarts=tuple(g["ns_gram_restarts"]), layout=layout_of(p, plan_rank))
                 for p, g in zip(params, groups)]
        if self.split_replicas is None:
            plan, split = plan_with_best_split(specs, len(ranks), self.max_batch_numel, self.cost_model(device.type))
            if any(spec.layout.has_replicas for spec in specs):
                logger.info("DMuon: the cost model %s Newton-Schulz across replicas (split_replicas=None)",
                            "splits" if split else "does not split")
        else:
            plan = make_owner_plan(specs, len(ranks), self.max_batch_numel, self.split_replicas)
        return OwnerRun(group, plan_rank[dist.get_rank()], params, plan, device,
                        staging=staging_for(local_of(params[0]).device, device))

    @staticmethod
    def _check_shards_agree_with_plan(run: OwnerRun) -> None:
        """Find the local shards that are not the block the plan assumes (``dmuon.plan.layout``),
        against DTensor's own answer and the local tensor's shape (e.g. uneven ``from_local``
        shards): each gets a stand-in, so this rank runs the plan's collectives, and
        :meth:`shard_problem` masks the step everywhere and raises here. Host facts only."""
        for j, (param, spec) in enumerate(zip(run.params, run.plan.params)):
            box = spec.layout.boxes(spec.shape)[run.rank]
            with host_tensor_ops():  # DTensor's answer does tensor work on the mesh
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                      param.placements)
            expected_offsets = [start for start, length in box if length]
            offsets = [o for o, (_, length) in zip(offset, box) if length]
            sizes = tuple(length for _, length in box)
            if sizes != tuple(shape) or sizes != tuple(param.to_local().shape) or offsets != expected_offsets:
                run.wrong_shards.append(j)
                run.stand_ins[j] = torch.zeros(sizes, dtype=param.dtype, device=local_of(param).device)

    def shard_problem(self, name_of: Callable[[torch.Tensor], str]) -> str | None:
        """This rank's wrong shards, as the error it raises after each step (None: none)."""
        if self.owner_run is None or not self.owner_run.wrong_shards:
            return None
        names = [name_of(self.owner_run.params[j]) for j in self.owner_run.wrong_shards]
        return (f"sharded parameter shard(s) {names} are not the blocks their placements describe. Shard them "
                "with FSDP2 or distribute_tensor, or pass use_muon=False for them.")

    def step(self, grads: Mapping[torch.Tensor, torch.Tensor], oks: Mapping[torch.Tensor, torch.Tensor],
             groups: Mapping[torch.Tensor, dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]],
             steps: GroupSteps, stats: CommStats, meter: ScratchMeter) -> None:
        """The fast path's step of every plan parameter, whatever its grad (:class:`FastStep`),
        under ``oks`` (each parameter's 0-dim device bool, made by the step's wait)."""
        if (run := self.owner_run) is None:
            return
        fast = FastStep(run, grads, oks, groups, state, steps)
        run_owner_plan(run.plan, group=run.group, rank=run.rank, device=run.device, callbacks=fast.callbacks(),
                       stats=stats, meter=meter, staging=run.staging)
        # After the exchange: every rank gets the NorMuon rows the owners wrote.
        share_second_moments(run.plan, run.rank, fast.rows, run.group, run.device)
        if run.staging is not None:
            run.staging.moments_down(fast.rows, fast.moments)


class FastStep:
    """One step of the fast path: the momentum EMA of every local shard kept in its parameter's
    dtype first (one list op per group; the others' as their blocks are packed,
    ``dmuon.step.converted_momenta``), then per batch, as the owner exchange calls its methods,
    the look-ahead packed (:meth:`pack_blocks`), Newton-Schulz on the owner (:meth:`orthogonalize`)
    and the apply to the local rows as results come back (:meth:`apply_blocks`)."""

    def __init__(self, run: OwnerRun, grads: Mapping[torch.Tensor, torch.Tensor],
                 oks: Mapping[torch.Tensor, torch.Tensor], groups: Mapping[torch.Tensor, dict[str, Any]],
                 state: Mapping[torch.Tensor, dict[str, Any]], steps: GroupSteps) -> None:
        self.run, self.steps, self.params = run, steps, run.params
        self.groups = [groups[p] for p in run.params]  # by plan parameter
        self.ok = [oks[p] for p in run.params]
        self.here = self.ok if run.staging is None else run.staging.masks(self.ok)  # where the elementwise rules run
        self.local_grads, local_bufs, self.converted = self.momentum_step(grads, state)
        # Zeros made for a parameter with no state yet must not outlive the step: not kept.
        self.bufs = run.blocks.kept("momentum_buffer", local_bufs, keep=not self.made_zeros)
        self.targets = run.blocks.kept("param", [run.local(j, p) for j, p in enumerate(run.params)], flat=True)
        self.moments, self.rows = self.second_moments(state)  # staged after the masks' wait (host_staging)
        self.lists = steps.lists_for_all(run.device, self.groups)  # for the ops spanning the plan's groups
        self.grad_blocks: dict[int, list[torch.Tensor]] = {}  # this step's grads, split on first use
        self.converted.unpacked(run.unpacked_units(), self.grad_blocks)
        self.buffers = NewtonSchulzBuffers()  # kept through a batch's Newton-Schulz, released after it

    def momentum_step(self, grads: Mapping[torch.Tensor, torch.Tensor], state: Mapping[torch.Tensor, dict[str, Any]]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], ConvertedMomenta]:
        """Each parameter's local grad; its momentum after this step's EMA (one list op per group,
        under the masks) where it is kept in the parameter's dtype (zeros before its state exists;
        a wrong shard's stand-in), else None; and the others, taking their EMA as packed."""
        run, oks, groups = self.run, self.here, self.groups
        local_bufs: list[torch.Tensor | None] = [None] * len(run.params)
        self.made_zeros = False
        converted = ConvertedMomenta(run.plan, run.blocks, run.rank, run.dtypes, run.device, oks, groups, self.steps)
        for j, param in enumerate(run.params):
            if j in run.stand_ins:
                local_bufs[j] = run.stand_ins[j]
            elif (momentum := kept_momentum(state.get(param))) is None:  # get: no empty state made
                local_bufs[j] = torch.zeros_like(local_of(param))  # nothing is stored: no state yet
                self.made_zeros = True
            elif momentum[1] is None and momentum[0].dtype == run.dtypes[j]:
                local_bufs[j] = local_of(momentum[0])
            else:
                converted.values[j] = local_of(momentum[0])
                if momentum[1] is not None:
                    converted.scales[j] = local_of(momentum[1])
        # Without a usable grad here, the momentum stands in for it (the masked EMA leaves it as
        # it is); a converted momentum's working copy takes that place block by block.
        local_grads = [run.local(j, grads[p]) if p in grads else local_bufs[j] for j, p in enumerate(run.params)]
        converted.grads = local_grads
        in_place = [j for j, buf in enumerate(local_bufs) if buf is not None]
        for group, members in by_group(in_place, groups):
            self.steps.momentum([local_bufs[j] for j in members], [local_grads[j] for j in members], group,
                                [oks[j] for j in members])
        return local_grads, local_bufs, converted

    def second_moments(self, state: Mapping[torch.Tensor, dict[str, Any]]
                       ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The NorMuon rows of this rank's state (zeros before it exists), and where Newton-Schulz
        reads and writes them (staged up)."""
        moments = {j: GroupSteps.second_moment(p, state)
                   for j, (p, group) in enumerate(zip(self.params, self.groups)) if group["normuon"]}
        return moments, moments if self.run.staging is None else self.run.staging.moments_up(moments)

    def pack_blocks(self, units: Sequence[int]) -> list[torch.Tensor]:
        """The look-ahead of this rank's block of each unit, in its parameter's dtype."""
        unit_grads, momenta = self.converted.blocks(units, self.grad_blocks, self.bufs)
        unit_groups = [self.groups[self.run.plan.units[i].param] for i in units]
        out: list[torch.Tensor] = [None] * len(units)  # type: ignore[list-item]
        for group, positions in by_group(range(len(units)), unit_groups):
            looks = self.steps.lookahead([unit_grads[k] for k in positions], [momenta[k] for k in positions], group)
            for k, look in zip(positions, looks):
                out[k] = look
        return out

    def update_of(self, i: int) -> torch.Tensor:
        """The bf16 update of unit ``i``, which this rank holds whole, as its matrix."""
        (update,) = self.pack_blocks([i])
        return compute_copy(update).view(self.run.plan.units[i].matrix)

    def orthogonalize(self, unit: Unit, matrix: torch.Tensor) -> torch.Tensor:
        """Newton-Schulz (and NorMuon) of one unit's matrix with its group's settings."""
        moment = self.rows.get(unit.param)
        return self.steps.orthogonalize(matrix, self.groups[unit.param],
                                        None if moment is None else moment[unit.dim0[0] : unit.dim0[1]],
                                        self.ok[unit.param], self.buffers)

    def apply_blocks(self, units: Sequence[int], orthos: Sequence[torch.Tensor]) -> None:
        """The decayed, scaled update of this rank's block of each unit with its result."""
        param_of = [self.run.plan.units[i].param for i in units]
        self.steps.apply_many([self.params[j] for j in param_of], [self.targets[i] for i in units], orthos,
                              [self.groups[j] for j in param_of], [self.here[j] for j in param_of])

    def zero_masked(self, units: Sequence[int], results: Sequence[torch.Tensor]) -> None:
        """The results of ``units`` set to ``+0.0`` where their parameter's mask is False,
        on the owner."""
        mask_(results, [self.ok[self.run.plan.units[i].param] for i in units], self.lists)

    def callbacks(self) -> Callbacks:
        """These methods, as the owner exchange calls them."""
        run = self.run
        return Callbacks(self.pack_blocks, self.update_of, self.orthogonalize, self.apply_blocks, run.layout,
                         run.widen if self.lists else Callbacks.widen, self.zero_masked,
                         self.buffers.release)
