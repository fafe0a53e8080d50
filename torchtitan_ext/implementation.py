"""TorchTitan's ``optimizer.implementation`` as DMuon's ``foreach`` and ``fused``. Written
once for both TorchTitan lines (0.2.x's ``[optimizer] implementation``, 0.3.x's
``OptimizersContainer.Config.implementation``); imports nothing from TorchTitan.

TorchTitan hands Adam/AdamW ``foreach`` / ``fused`` from it; DMuon has two parts, so:

* ``"for-loop"``: ``foreach=False``: Muon's elementwise rules and the AdamW part one
  tensor at a time (``torch.optim.AdamW(foreach=False)``'s bits);
* ``"foreach"``: ``foreach=True``: both as list ops (``torch.optim.AdamW(foreach=True)``'s bits);
* ``"fused"`` (TorchTitan's default): ``foreach=True`` (Muon has no fused kernel: list ops)
  and ``fused=True``, torch's fused AdamW for the AdamW part
  (``torch.optim.AdamW(fused=True)``'s bits), where torch has that kernel for every
  parameter (floating point, on CUDA or CPU among others); elsewhere ``fused=False``:
  the AdamW part as list ops;
* ``"fused_opt_states_bf16"`` (0.3.x only): as ``"fused"``. Its bf16 Adam states come from
  a hook TorchTitan registers on torch's Adam/AdamW alone; DMuon's AdamW part keeps its
  states in the parameters' dtype.

The values are those of the whole optimizer; a DMuon param group may still set its own
``foreach`` / ``fused`` (docs/optimizer.md, "foreach and fused").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from dmuon.options import takes_fused_adamw

# TorchTitan's values of ``implementation``: 0.2.x's, and 0.3.x's.
IMPLEMENTATIONS_0_2 = ("for-loop", "foreach", "fused")
IMPLEMENTATIONS = (*IMPLEMENTATIONS_0_2, "fused_opt_states_bf16")


def dmuon_implementation(implementation: str, params: Iterable[torch.Tensor] = (),
                         choices: tuple[str, ...] = IMPLEMENTATIONS) -> dict[str, bool]:
    """DMuon's ``foreach`` and ``fused`` for TorchTitan's ``implementation`` (one of
    ``choices``, the TorchTitan line's), given the parameters the optimizer will hold
    (none: as if torch had the fused kernel for them, which a config check without a
    model assumes). TorchTitan checks the value only in its own AdamW builder, which a
    DMuon job skips (and a TOML value reaches the config unchecked): so it is checked here."""
    if implementation not in choices:
        raise ValueError(f"optimizer.implementation must be one of {choices}, got {implementation!r}")
    if implementation == "for-loop":
        return {"foreach": False, "fused": False}
    if implementation == "foreach":
        return {"foreach": True, "fused": False}
    return {"foreach": True, "fused": all(takes_fused_adamw(p) for p in params)}
