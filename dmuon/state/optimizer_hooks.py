"""The torch hooks a ``DMuon`` carries (attached at construction and again on a copy, since
torch's hooks do not pickle):

- ``load_state_dict`` keeps this optimizer's options where the saved ones differ
  (``dmuon.state.resume_contract``);
- ``state_dict`` first settles the last step (:func:`settle_last_step`), so a checkpoint
  never holds the host changes of a step the device masked or skipped.
"""

from __future__ import annotations

from typing import Any

from dmuon.state.resume_contract import apply_resume_contract
from dmuon.torch_compat import has_optimizer_hook


def attach_hooks(optimizer: Any) -> None:
    """Attach both hooks to ``optimizer`` (a ``DMuon``), once."""
    if not has_optimizer_hook(optimizer, "load_state_dict", apply_resume_contract):
        optimizer.register_load_state_dict_pre_hook(apply_resume_contract)
    if not has_optimizer_hook(optimizer, "state_dict", settle_last_step):
        optimizer.register_state_dict_pre_hook(settle_last_step)


def settle_last_step(optimizer: Any) -> None:
    """``state_dict``'s pre-hook: read the last step's status now (a wait for the device,
    outside ``step()``) and take back the host changes of a step it masked (torch's host
    AdamW counters, state made for a first grad), so the saved state is the one of a run
    that never took that step. An error it shows is still raised by the next ``step()``."""
    phases = optimizer.phases
    if phases.grad_status.settle():
        phases.rollback.undo()
