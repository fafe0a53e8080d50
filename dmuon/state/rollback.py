"""What a step changes on the host, where the device mask cannot reach it: the state it makes
for a parameter's first grad and the AdamW step counters torch keeps on the host.

A step whose mask turns out False on the device (another rank's problem, grads that disagree across
ranks) must change nothing, yet this rank learns that only at the next ``step()``, when the status
sums reach the host (``dmuon.exchange.grad_status``). So the step records these host changes here,
and the next step undoes them, before anything else, when it learns the step was masked: state made
by a masked step was never written by it (zeros, counters at 0), so removing it restores the
state's keys exactly, and a counter incremented by a masked step goes back by exactly 1."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

import torch


class StateRollback:
    """The last step's host changes, kept until the next step knows whether it was masked."""

    def __init__(self) -> None:
        self._made: list[tuple[MutableMapping[torch.Tensor, dict[str, Any]], torch.Tensor, list[str]]] = []
        self._counters: list[torch.Tensor] = []

    def made(self, state: MutableMapping[torch.Tensor, dict[str, Any]], param: torch.Tensor,
             keys: Iterable[str]) -> None:
        """``param``'s state ``keys`` were made by this step."""
        self._made.append((state, param, list(keys)))

    def counted(self, counters: Iterable[torch.Tensor]) -> None:
        """These host step counters were incremented by this step under a device mask."""
        self._counters.extend(counters)

    def undo(self) -> None:
        """The last step was masked: take its host changes back."""
        for state, param, keys in self._made:
            entry = state.get(param)
            if entry is None:
                continue
            for key in keys:
                entry.pop(key, None)
            if not entry:
                del state[param]
        for counter in self._counters:
            counter.sub_(1)
        self.keep()

    def keep(self) -> None:
        """The last step stood (or nothing was recorded): start afresh."""
        self._made, self._counters = [], []
