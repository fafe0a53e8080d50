"""The fast path's momenta kept in another dtype than their parameter's (bf16, int8), taken
block by block as the owner exchange packs them. A momentum in its parameter's dtype takes its
EMA in place before the exchange (``dmuon.step.fast_path``); a narrower one needs a working copy,
and copies of every momentum at once would raise the peak by the rank's whole momentum (416 MiB
on a llama3 8B rank at P = 64): here each block's copy lives from its packing to its look-ahead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dmuon.step.group_steps import GroupSteps, by_group
from dmuon.state.kept_state import MomentumReads
from dmuon.numerics.update_rules import bounded_chunks
from dmuon.plan.local_blocks import LocalBlocks
from dmuon.plan.owner_plan import OwnerPlan
from dmuon.plan.pack_layout import PACK_CHUNK_NUMEL


@dataclass
class ConvertedMomenta:
    """One step's converted momenta, each block's read, updated and stored once a step as the
    exchange packs it (:meth:`blocks`; never packed: :meth:`unpacked`), one pack chunk at a time."""

    plan: OwnerPlan
    blocks_here: LocalBlocks  # this rank's blocks of the plan's units (OwnerRun.blocks)
    rank: int
    dtypes: Sequence[torch.dtype]  # each plan parameter's: what its momentum is read as
    device: torch.device
    oks: Sequence[torch.Tensor]  # each plan parameter's 0-dim device bool: where its EMA and store run
    groups: Sequence[dict[str, Any]]
    steps: GroupSteps
    values: dict[int, torch.Tensor] = field(default_factory=dict)  # per converted parameter: kept local values
    scales: dict[int, torch.Tensor] = field(default_factory=dict)  # per int8 one: its local scales
    grads: Sequence[torch.Tensor | None] = ()  # each plan parameter's local grad (None: none usable here)
    _value_blocks: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _scale_blocks: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def blocks(self, units: Sequence[int], grad_blocks: dict[int, list[torch.Tensor]],
               bufs: Mapping[int, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The grad and the momentum after this step's EMA of this rank's block of each of
        ``units``: the kept views ``bufs`` where the momentum is its own working tensor (its
        EMA ran), else one read, updated and stored back now. ``grad_blocks``: the step's cache
        of split grads."""
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
        """The EMA and store of the converted blocks of ``units`` this rank never packs, a pack
        chunk at a time."""
        mine = [i for i in units if self.plan.units[i].param in self.values]
        for chunk in bounded_chunks([self.plan.units[i].block_numel(self.rank) for i in mine], PACK_CHUNK_NUMEL):
            self.blocks([mine[k] for k in chunk], grad_blocks, {})
