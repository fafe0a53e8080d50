"""DMuon's read-only queries: names, paths, plans, QK-clip's logits, skipped steps and the
last step's figures. None of them runs a collective, so each is safe to call on one rank
only (logging code); kept apart from the optimizer's state and step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dmuon.attention.max_logits import MaxLogitTracker
from dmuon.plan.owner_plan import OwnerPlan
from dmuon.telemetry import StepFigures

if TYPE_CHECKING:
    from dmuon.attention.clipping import AttentionClip
    from dmuon.exchange.grad_status import GradStatus
    from dmuon.fast_path import FastPath
    from dmuon.telemetry import Telemetry


class OptimizerQueries:
    """The queries of ``DMuon`` (a mixin: it reads the optimizer's attributes)."""

    _names: dict[torch.Tensor, str]
    _attention_clip: AttentionClip
    _grad_status: GradStatus
    _telemetry: Telemetry
    _fast_path: FastPath

    def _paths(self) -> dict[torch.Tensor, str]:
        raise NotImplementedError

    @property
    def max_logits(self) -> MaxLogitTracker:
        """Where the model reports attention logits for QK-clip (``dmuon.attention.max_logits``)."""
        return self._attention_clip.tracker

    def last_max_logits(self) -> dict[str, torch.Tensor]:
        """Each attention's per-head largest logit of the last step, before clipping."""
        return self._attention_clip.last_max_logits()

    def param_name(self, param: torch.Tensor) -> str:
        """The name a parameter was given (or its group position)."""
        return self._names.get(param, "<unnamed parameter>")

    def comm_paths(self) -> dict[str, str]:
        """Name -> path (``local``, ``all_to_all`` or ``redistribute``) of every Muon parameter:
        a pure query (no collective), safe to call on one rank only, e.g. in logging code."""
        return {self.param_name(p): path for p, path in self._paths().items()}

    @property
    def skipped_steps(self) -> int:
        """Steps ``skip_nonfinite`` skipped, counted when the next ``step()`` or ``state_dict()`` reads them."""
        return self._grad_status.skipped_steps

    def telemetry(self) -> StepFigures | None:
        """The last step's figures (``dmuon.telemetry``), None if off or before a step; local to this rank."""
        figures = self._telemetry.last_step()
        return None if figures is None else figures.with_skipped(self.skipped_steps)

    def owner_plans(self) -> list[OwnerPlan]:
        """The fast path's plan of each mesh (made at the first ``step()``; empty before)."""
        return self._fast_path.owner_plans()
