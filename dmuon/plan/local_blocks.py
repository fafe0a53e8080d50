"""This rank's block of every unit of an owner plan, as views of its parameters' local
tensors: computed once per plan, the views of tensors that persist (parameters, momentum
buffers) kept while those tensors stay the same objects. A rank's blocks of one parameter
tile its local tensor's dim 0 in unit order, so one ``split`` gives all of them, and a
parameter held as one block is its local tensor itself: no op at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.plan.owner_plan import OwnerPlan


class LocalBlocks:
    """The blocks ``rank`` holds of ``plan``'s units, by unit."""

    def __init__(self, plan: OwnerPlan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        # Per plan parameter: the units this rank holds a block of (in dim-0 order) and
        # the blocks' rows.
        self._units: dict[int, list[int]] = {}
        self._rows: dict[int, list[int]] = {}
        for i, unit in enumerate(plan.units):
            if (block := unit.block(rank)) is not None:
                self._units.setdefault(unit.param, []).append(i)
                self._rows.setdefault(unit.param, []).append(block.hi - block.lo)
        self._position = {i: (j, k) for j, units in self._units.items() for k, i in enumerate(units)}
        self._kept: dict[str, tuple[list[torch.Tensor], dict[int, torch.Tensor]]] = {}

    def blocks_of(self, param: int, local: torch.Tensor) -> list[torch.Tensor]:
        """This rank's blocks of plan parameter ``param`` from a tensor laid out like its
        local tensor (its grad, momentum or the parameter), in unit order."""
        rows = self._rows[param]
        if len(rows) == 1 and rows[0] == local.shape[0]:
            return [local]
        return list(local.split(rows))

    def block(self, unit: int, blocks: dict[int, list[torch.Tensor]], local_of: Sequence[torch.Tensor]
              ) -> torch.Tensor:
        """Unit ``unit``'s block of the tensors ``local_of`` (by plan parameter), split on
        first use into ``blocks`` (one step's cache)."""
        param, k = self._position[unit]
        if param not in blocks:
            blocks[param] = self.blocks_of(param, local_of[param])
        return blocks[param][k]

    def kept(self, name: str, locals_: Sequence[torch.Tensor | None], flat: bool = False,
             keep: bool = True) -> dict[int, torch.Tensor]:
        """Every held unit's block of the persistent tensors ``locals_`` (by plan
        parameter; flat 1-D views where the block is contiguous with ``flat``), made once
        and remade only when one of the tensors is a new object; not kept past the call
        with ``keep=False`` (``locals_`` holds a tensor of this step only)."""
        cached = self._kept.get(name)
        if cached is not None and len(cached[0]) == len(locals_) and all(a is b for a, b in zip(cached[0], locals_)):
            return cached[1]
        views: dict[int, torch.Tensor] = {}
        for param, units in self._units.items():
            if locals_[param] is None:  # no state yet (no grad so far)
                continue
            for i, view in zip(units, self.blocks_of(param, locals_[param])):
                if flat:
                    view = view.view(-1 if view.is_contiguous() else self.plan.units[i].block(self.rank).shape)
                views[i] = view
        if keep:
            self._kept[name] = (list(locals_), views)
        else:
            self._kept.pop(name, None)
        return views
