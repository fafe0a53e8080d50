"""The fast path's momenta kept in another dtype than their parameter's (bf16, int8), taken
block by block as the owner exchange packs them (issue 59, item 2).

A momentum held in its parameter's dtype is its own working tensor: the fast path runs its
EMA in place on the whole local shard before the exchange (``dmuon.step.fast_path``). One kept
narrower would need a parameter-dtype copy to run the rule on; made for every momentum at
once and kept through the exchange, those copies raised the step's peak by the rank's whole
momentum in the parameter's dtype (416 MiB on a llama3 8B rank at P = 64), and under a CUDA
graph the pool kept that reserved. Here each block's copy lives from the moment its block is
packed to the moment its look-ahead is made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dmuon.step.group_steps import GroupSteps, by_group
from dmuon.state.momentum_state import MomentumReads
from dmuon.numerics.update_lists import bounded_chunks
from dmuon.plan.local_blocks import LocalBlocks
from dmuon.plan.owner_plan import OwnerPlan
from dmuon.plan.pack_layout import PACK_CHUNK_NUMEL


@dataclass
class ConvertedMomenta:
    """One step's fast-path momenta kept in another dtype than their parameter's (bf16, int8),
    taken block by block: each block's momentum is read in the parameter's dtype, takes its
    EMA, is rounded back into its store and handed to the look-ahead when the exchange packs
    that block (:meth:`blocks`), then let go. So the step holds parameter-dtype copies of one
    pack chunk's momenta at a time (``dmuon.plan.pack_layout.PACK_CHUNK_NUMEL``), not of all
    of them (the dry run: the same peak as the parameter-dtype momentum's at llama3 8B and 70B
    scale, eager or captured). Each block is read and stored once a step (a unit is packed
    once; the blocks a rank never packs take theirs in :meth:`unpacked`)."""

    plan: OwnerPlan
    blocks_here: LocalBlocks
    """This rank's blocks of the plan's units (``OwnerRun.blocks``)."""
    rank: int
    dtypes: Sequence[torch.dtype]
    """Each plan parameter's dtype: what its momentum is read as."""
    device: torch.device
    oks: Sequence[torch.Tensor]
    """Each plan parameter's 0-dim device bool: where its EMA and store run."""
    groups: Sequence[dict[str, Any]]
    steps: GroupSteps
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per converted plan parameter: its kept momentum's local values."""
    scales: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per converted plan parameter kept in int8: its local scales."""
    grads: Sequence[torch.Tensor | None] = ()
    """Each plan parameter's local grad (None: a converted momentum without a usable grad here)."""
    _value_blocks: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _scale_blocks: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def blocks(self, units: Sequence[int], grad_blocks: dict[int, list[torch.Tensor]],
               bufs: Mapping[int, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The grad and the momentum after this step's EMA of this rank's block of each of
        ``units``: the kept block views ``bufs`` where the momentum is its own working tensor
        (its EMA ran already), else a new tensor read, updated and stored back now (one list
        op per group for the EMA, a few for the read and the store). ``grad_blocks``: the
        step's cache of split grads."""
        params = [self.plan.units[i].param for i in units]
        todo = [k for k, j in enumerate(params) if j in self.values]
        grads = [None if self.grads[j] is None else self.blocks_here.block(i, grad_blocks, self.grads)
                 for i, j in zip(units, params)]
        momenta = [None if j in self.values else bufs[i] for i, j in zip(units, params)]
        if todo:
            reads = MomentumReads()
            work = reads.read_kept(
                [self.blocks_here.block(units[k], self._value_blocks, self.values) for k in todo],
                [self.blocks_here.block(units[k], self._scale_blocks, self.scales) if params[k] in self.scales
                 else None for k in todo],
                [self.dtypes[params[k]] for k in todo], [self.oks[params[k]] for k in todo])
            for k, momentum in zip(todo, work):
                momenta[k] = momentum
                if grads[k] is None:  # no usable grad: the momentum stands in (its masked EMA keeps it)
                    grads[k] = momentum
            for group, members in by_group(range(len(todo)), [self.groups[params[k]] for k in todo]):
                self.steps.momentum([work[m] for m in members], [grads[todo[m]] for m in members], group,
                                    [self.oks[params[todo[m]]] for m in members])
            reads.store(self.steps.lists_for_all(self.device, [self.groups[params[k]] for k in todo]))
        return grads, momenta  # type: ignore[return-value]

    def unpacked(self, units: Sequence[int], grad_blocks: dict[int, list[torch.Tensor]]) -> None:
        """The EMA and store of the converted blocks of ``units``, which this rank holds but
        never packs (``OwnerRun.unpacked_units``), a pack chunk at a time."""
        mine = [i for i in units if self.plan.units[i].param in self.values]
        for chunk in bounded_chunks([self.plan.units[i].block_numel(self.rank) for i in mine], PACK_CHUNK_NUMEL):
            self.blocks([mine[k] for k in chunk], grad_blocks, {})
