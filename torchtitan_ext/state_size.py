"""One log line per DMuon after its first step: the optimizer state it keeps on this rank,
Muon's and AdamW's, in bytes per parameter element (what ``[optimizer] momentum_dtype``
changes), in TorchTitan's log style. Both TorchTitan lines' containers call
:func:`log_state_size_after_first_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dmuon import DMuon

MiB = 2**20


def state_size_line(optimizer: DMuon, part: int) -> str:
    """The line for model part ``part``'s DMuon (``DMuon.state_bytes()``)."""
    size = optimizer.state_bytes()
    kept = sorted({str(g["momentum_dtype"]) for g in optimizer.param_groups if g["use_muon"]})
    return (f"DMuon (model part {part}): optimizer state on this rank: Muon {size.muon_bytes / MiB:.2f} MiB "
            f"({size.muon_bytes_per_element:.3f} bytes per element, momentum_dtype {', '.join(kept)}), "
            f"AdamW {size.adamw_bytes / MiB:.2f} MiB ({size.adamw_bytes_per_element:.3f} bytes per element)")


def log_state_size_after_first_step(optimizers: Sequence[Any], log: Callable[[str], None]) -> None:
    """After each DMuon's first ``step()``, ``log`` its :func:`state_size_line` once (a step
    post-hook that removes itself; no collective)."""
    def hook(part: int) -> Callable[..., None]:
        def log_once(optimizer: DMuon, *_: Any) -> None:
            handles.pop(part).remove()
            log(state_size_line(optimizer, part))
        return log_once

    dmuons = [o for o in optimizers if isinstance(o, DMuon)]
    handles = {part: optimizer.register_step_post_hook(hook(part)) for part, optimizer in enumerate(dmuons)}
