"""``capture_step``: a TorchTitan container whose DMuon steps are captured in CUDA graphs.

Both lines' containers take :class:`CapturedSteps` as a mixin. When the config turns
``capture_step`` on, each DMuon is built with ``capturable=True`` (its learning rate and
weight decay on the GPU, where TorchTitan's LR scheduler fills them) and
:meth:`CapturedSteps.capture_optimizer_steps` wraps it in ``dmuon.capture.cuda_graphs.CapturedStep``:
eager for a few warm-up steps, then one graph replayed at every step. The container's
``zero_grad`` then keeps the grad tensors (``set_to_none=False``, as TorchTitan 0.3's own
graphs of the forward and backward need too), since the graph reads them where they are;
and ``torch.distributed.destroy_process_group`` first releases the graphs (their NCCL
work must not outlive the process group). A replay raises no error and counts no skipped
step by itself: :meth:`CapturedSteps.check_captured_steps` does (``CapturedStep.check``),
and the metrics processor calls it at each logging step (``torchtitan_ext.step_figures``),
where TorchTitan already waits for the loss: an error the replays found is raised there,
and the step line ends with ``skipped: N`` once a step was skipped.

Refused where it cannot hold, with the field named: on a job whose parameters are not on
a CUDA device (CPU runs, FSDP2's CPU offload), and by ``CapturedStep`` for telemetry and
QK-clip. Not yet run on a GPU: no session of this project has had one.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dmuon import CapturedStep, DMuon

# Every CapturedStep a container made, released before the process group is destroyed.
_LIVE: weakref.WeakSet[CapturedStep] = weakref.WeakSet()


def capture_refusal(params: Iterable[torch.Tensor], field: str) -> str | None:
    """Why ``field`` cannot capture the steps of an optimizer of ``params`` (None: it can);
    asked before the optimizer is built, so this is the message a CPU run gets."""
    places = sorted({p.device.type for p in params})  # a DTensor's: its shard's
    if places != ["cuda"]:
        return (f"{field} captures the optimizer step in a CUDA graph: CUDA only, and this job's parameters are on "
                f"{', '.join(places) or 'no device'} (a CPU run, or FSDP2's CPU offload); set it to false")
    return None


def _release_first(destroy: Any) -> Any:
    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        for captured in list(_LIVE):
            captured.release()
        return destroy(*args, **kwargs)
    destroy_process_group.releases_captured_steps = True  # type: ignore[attr-defined]
    return destroy_process_group


def _release_graphs_before_destroy() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` once so it releases the graphs first."""
    if not getattr(dist.destroy_process_group, "releases_captured_steps", False):
        dist.destroy_process_group = _release_first(dist.destroy_process_group)


class CapturedSteps:
    """The part of a DMuon container that captures its steps (module docstring)."""

    optimizers: list[Any]
    captured_steps: list[CapturedStep | None] | None = None

    def capture_optimizer_steps(self) -> None:
        """Step every DMuon through a CapturedStep from now on (the builders refuse a job off
        the GPU first, naming their field: :func:`capture_refusal`; CapturedStep refuses it too)."""
        # One memory pool for every model part's graph: each keeps its pool's peak reserved, and
        # the parts' steps replay one after another in capture order (CapturedStep's pool=).
        dmuons = [o for o in self.optimizers if isinstance(o, DMuon)]
        pool = torch.cuda.graph_pool_handle() if len(dmuons) > 1 and torch.cuda.is_available() else None
        self.captured_steps = [CapturedStep(o, pool=pool) if isinstance(o, DMuon) else None for o in self.optimizers]
        _LIVE.update(c for c in self.captured_steps if c is not None)
        _release_graphs_before_destroy()

    def check_captured_steps(self) -> int | None:
        """Read what the replays since the last call found (a wait for the GPU): raise the
        first error, return this rank's skipped steps so far: the most any of its DMuons (model
        parts) skipped, as the step's figures count them (None when the steps are not captured)."""
        if self.captured_steps is None:
            return None
        for captured in self.captured_steps:
            if captured is not None:
                captured.check()
        return max((o.skipped_steps for o in self.optimizers if isinstance(o, DMuon)), default=0)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.captured_steps is None:
            return super().step(*args, **kwargs)  # type: ignore[misc]
        for optimizer, captured in zip(self.optimizers, self.captured_steps):
            if captured is None:
                optimizer.step(*args, **kwargs)
            else:
                captured.step()

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self.captured_steps is not None:  # the graph reads the grads where they are
            kwargs["set_to_none"] = False
        super().zero_grad(*args, **kwargs)  # type: ignore[misc]
