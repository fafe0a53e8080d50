"""How a DMuon pickles and deep-copies: torch's defaults, state and param_groups, plus
its configuration. The paths and owner plan are derived from the parameters (and a plan
holds process groups, which do not pickle): the copy rebuilds them at its first step.
Its measurements (comm_stats, scratch_stats, telemetry) start afresh."""

from __future__ import annotations

from typing import Any

from dmuon.state.optimizer_hooks import attach_hooks
from dmuon.options.table import OPTIMIZER_ATTRIBUTES

# What a pickle keeps besides torch's defaults, state and param_groups: the optimizer's own
# records and, from the option table, the options a DMuon keeps as attributes.
PICKLED_ATTRIBUTES = ("_muon_defaults", "_adamw_defaults", "_names", "_groups_added", *OPTIMIZER_ATTRIBUTES)
# The key under which a pickle keeps ``telemetry``. It also tells __setstate__ that it
# makes a copy: load_state_dict calls it too, with only state and param_groups.
TELEMETRY_STATE_KEY = "telemetry_enabled"


class PicklesConfiguration:
    """``__getstate__`` / ``__setstate__`` for :class:`dmuon.DMuon` (a mixin before
    ``torch.optim.Optimizer``); the class provides ``phases`` and ``start_afresh``."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in PICKLED_ATTRIBUTES})
        state[TELEMETRY_STATE_KEY] = self.phases.telemetry.enabled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        telemetry = state.pop(TELEMETRY_STATE_KEY, None)
        super().__setstate__(state)
        # torch's __setstate__ (also run by load_state_dict) adds differentiable=False to
        # defaults; DMuon has no such option, and defaults stay the keys a group may set.
        self.defaults.pop("differentiable", None)
        if telemetry is not None:  # a copy, not load_state_dict: nothing derived came with it
            self.start_afresh(telemetry)
            attach_hooks(self)  # torch's hooks do not pickle: the copy keeps them
