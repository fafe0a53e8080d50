"""``DMuon.step`` captured once in a CUDA graph and replayed every training step.

A captured step launches its hundreds (or, for a large MoE under EP, thousands) of kernels
and its collectives as one graph: no launch overhead and no host work per step. What makes
that correct under a learning-rate schedule is ``DMuon(capturable=True)``: the groups'
``lr`` and ``weight_decay`` are device tensors that the scheduler fills in place and the
step reads on the device (``dmuon.numerics.device_scalars``).

Use (docs/optimizer.md, "A captured step")::

    optimizer = DMuon(model.named_parameters(), lr=0.02, capturable=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    captured = CapturedStep(optimizer)           # refuses what cannot be captured
    for batch in data:
        loss = model(batch).backward()           # grads accumulated in place
        captured.step()                          # eager for the warm-up steps, then the graph
        scheduler.step()
        model.zero_grad(set_to_none=False)       # the graph reads the grads where they are
    captured.release()                           # before destroy_process_group()

What a replay does not do (the host code of ``step()`` does not run): it raises no error
of the step's status (a bad grad still masks the step on the device, on every rank) and
counts no skipped step. :meth:`CapturedStep.check` reads the last replay's status (a wait
for the device) and raises or counts what it shows: call it where the job already waits,
e.g. when it logs the loss. A status of an earlier replay is overwritten by the next one.

Refused at construction, each with the reason: ``capturable=False`` (the learning rate
would be the capture's forever), telemetry (it times with host events), QK-clip (its
reports are host bookkeeping of the forward), parameters off the GPU (FSDP2's CPU offload:
the step runs on the host); at capture: a parameter without a grad. At each replay, host
checks only: a replaced grad or hyperparameter tensor, or a changed option (momentum,
``ns_steps``, ...: fixed at capture), raises instead of replaying a stale graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dmuon.device_hyperparameters import SCHEDULER_VALUES
from dmuon.numerics.device_scalars import DEVICE_HYPERPARAMETERS
from dmuon.optimizer_hooks import settle_last_step
from dmuon.torch_compat import local_of

if TYPE_CHECKING:
    from dmuon.optimizer import DMuon

# Eager steps before the capture: state, plan, layouts and NCCL's communicators made.
DEFAULT_WARMUP_STEPS = 3
# Group keys a replay may see change: the device hyperparameters (read on the device) and
# what schedulers keep beside them.
_MAY_CHANGE = {"params", *DEVICE_HYPERPARAMETERS, *SCHEDULER_VALUES}


def capture_problems(optimizer: DMuon) -> list[str]:
    """Why ``optimizer``'s step cannot be captured, in words (empty: it can)."""
    problems = []
    if not all(group.get("capturable") for group in optimizer.param_groups):
        problems.append("capturable=False: lr and weight_decay would be the capture's forever; construct DMuon "
                        "with capturable=True")
    if optimizer.phases.telemetry.enabled:
        problems.append("telemetry=True: it times each step with host events; turn it off for the captured run")
    if optimizer.phases.attention_clip.targets:
        problems.append("QK-clip: its reports are host bookkeeping of the forward; run QK-clip steps eagerly")
    off_gpu = [optimizer.param_name(p) for g in optimizer.param_groups for p in g["params"]
               if local_of(p).device.type != "cuda"]
    if off_gpu:
        problems.append(f"parameters not on a CUDA device (FSDP2's CPU offload steps on the host): {off_gpu[:3]}"
                        f"{' ...' if len(off_gpu) > 3 else ''}")
    return problems


class CapturedStep:
    """``optimizer.step()`` eagerly for ``warmup_steps`` calls, then captured once and
    replayed at every call (module docstring)."""

    def __init__(self, optimizer: DMuon, warmup_steps: int = DEFAULT_WARMUP_STEPS) -> None:
        problems = capture_problems(optimizer)
        if problems:
            raise ValueError("dmuon.cuda_graphs: this DMuon's step cannot be captured: " + "; ".join(problems))
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"dmuon.cuda_graphs: warmup_steps must be an int >= 1, got {warmup_steps!r}")
        self.optimizer, self.warmup_steps = optimizer, warmup_steps
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._captured: list[tuple[Any, ...]] = []  # what each replay must still find
        self._status_copies: list[tuple[Any, Any]] = []  # the status the graph copies to the host

    def step(self) -> None:
        """One optimizer step: eager during the warm-up, then the graph."""
        if self.graph is None:
            self._check_grads()
            if self.eager_steps < self.warmup_steps or self._last_status_failed():
                self._eager_step()  # an error the last status holds is raised by it, as eagerly
                return
            self._capture()
        self._check_unchanged()
        self.graph.replay()

    def check(self) -> None:
        """Wait for the last replay and raise what the step's status found (as the next eager
        ``step()`` would); the skipped steps are counted (``DMuon.skipped_steps``)."""
        torch.cuda.current_stream().synchronize()
        if self.graph is not None:  # the last replay's status, in the pinned memory the graph writes
            self.optimizer.phases.grad_status.read_replayed(self._status_copies)
        settle_last_step(self.optimizer)
        error = self.optimizer.phases.grad_status.take_held()
        if error is not None:
            raise error

    def _last_status_failed(self) -> bool:
        """Read the last eager step's status now (a capture may not wait for it): whether it
        holds an error (then the step is not captured: it would be captured masked)."""
        torch.cuda.current_stream().synchronize()
        settle_last_step(self.optimizer)
        return self.optimizer.phases.grad_status.holds_error()

    def release(self) -> None:
        """Free the graph (its memory pool and the collectives it holds): call it before the
        process group is destroyed. A later ``step()`` captures again."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
        self.graph, self._captured = None, []
        self.eager_steps = 0

    def _eager_step(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's capture recipe does
            self.optimizer.step()
        torch.cuda.current_stream().wait_stream(side)
        self.eager_steps += 1

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.optimizer.step()  # recorded, not run: the replay that follows runs it
        self.graph, self._captured = graph, self._fingerprint()
        self._status_copies = self.optimizer.phases.grad_status.take_graph_copies()

    def _fingerprint(self) -> list[tuple[Any, ...]]:
        """Each group's tensors the graph reads (by identity) and its other options (by value)."""
        found = []
        for group in self.optimizer.param_groups:
            grads = tuple(id(p.grad) for p in group["params"])
            scalars = tuple(id(group[key]) for key in DEVICE_HYPERPARAMETERS)
            options = tuple(sorted((k, repr(v)) for k, v in group.items() if k not in _MAY_CHANGE))
            found.append((grads, scalars, options))
        return found

    def _check_grads(self) -> None:
        missing = [self.optimizer.param_name(p) for g in self.optimizer.param_groups for p in g["params"]
                   if p.grad is None]
        if missing:
            raise ValueError(f"dmuon.cuda_graphs: no grad for {missing[:3]}{' ...' if len(missing) > 3 else ''}: a "
                             "captured step reads every grad where it is; give every parameter a grad and zero them "
                             "with zero_grad(set_to_none=False)")

    def _check_unchanged(self) -> None:
        now = self._fingerprint()
        for index, (before, after) in enumerate(zip(self._captured, now)):
            what = [name for name, a, b in zip(("a grad tensor (zero_grad(set_to_none=False) keeps them)",
                                                "lr or weight_decay's tensor (fill_ it in place)",
                                                "an option"), before, after) if a != b]
            if what:
                raise RuntimeError(f"dmuon.cuda_graphs: param group {index} changed since the capture ({what[0]}); "
                                   "the graph would replay the old one: call release() and step again to capture "
                                   "anew")
        if len(now) != len(self._captured):
            raise RuntimeError("dmuon.cuda_graphs: param groups were added since the capture: call release() and "
                               "step again to capture anew")
