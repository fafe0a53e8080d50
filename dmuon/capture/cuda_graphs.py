"""``DMuon.step`` captured once in a CUDA graph and replayed every training step.

A captured step launches its hundreds (or, for a large MoE under EP, thousands) of kernels and
its collectives as one graph: no launch overhead and no host work per step. What makes that
correct under a learning-rate schedule is ``DMuon(capturable=True)``: the groups' ``lr`` and
``weight_decay`` are device tensors that the scheduler fills in place and the step reads on the
device (``dmuon.numerics.device_scalars``).

Use: docs/optimizer.md, "A captured step".

What a replay does not do (the host code of ``step()`` does not run): it raises no error of the
step's status (a bad grad still masks the step on the device, on every rank) and counts no
skipped step as it goes. Each replay adds its status to counts kept on the device
(``dmuon.exchange.status_masks.ReplayTally``); :meth:`CapturedStep.check` waits for the device,
counts the skipped steps since its last call (``DMuon.skipped_steps``) and raises the error of
the first replay that found one: call it where the job already waits, e.g. when it logs the
loss (TorchTitan's captured container does, at each logging step).

Refused at construction, each with the reason (:func:`capture_problems`), and at capture a
parameter without a grad. Before each replay, host checks only
(``dmuon.capture.replay_guard``). ``load_state_dict`` copies the loaded state into the tensors
the graph reads (``dmuon.state.loading``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dmuon.options.device_hyperparameters import place_on_device
from dmuon.exchange.status_masks import ReplayTally
from dmuon.state.optimizer_hooks import settle_last_step
from dmuon.capture.replay_guard import ReplayGuard
from dmuon.torch_compat import local_of

if TYPE_CHECKING:
    from dmuon.optimizer import DMuon

# Eager steps before the capture: state, plan, layouts and NCCL's communicators made.
DEFAULT_WARMUP_STEPS = 3


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


def device_problem(device: torch.device, current: int) -> str | None:
    """Why a step on parameters of ``device`` cannot be captured while ``current`` is the
    current CUDA device (None: it can). The side and capture streams are made on the current
    device: a rank that never called ``set_device`` would capture on cuda:0 while its kernels
    run on its own GPU, and every replay would do nothing (torch only warns)."""
    if device.type != "cuda" or device.index is None or device.index == current:
        return None
    return (f"the parameters are on cuda:{device.index} but the current CUDA device is cuda:{current}: a capture "
            f"there would record nothing of the step; call torch.cuda.set_device({device.index}) before stepping "
            "(torchrun jobs set it per rank from LOCAL_RANK)")


class CapturedStep:
    """``optimizer.step()`` eagerly for ``warmup_steps`` calls, then captured once and replayed
    at every call (module docstring)."""

    def __init__(self, optimizer: DMuon, warmup_steps: int = DEFAULT_WARMUP_STEPS, pool: Any = None) -> None:
        """``pool``: a memory pool to capture into, shared with other graphs
        (``torch.cuda.graph_pool_handle()``, or another captured step's :attr:`pool`): a graph
        keeps its pool's peak reserved while it lives, so the steps of several optimizers (one
        per pipeline stage) hold one step's peak, not one each. Graphs sharing a pool must be
        replayed in the order they were captured, one after another, as a training loop steps
        its optimizers (``torch.cuda.graph``'s ``pool``)."""
        problems = capture_problems(optimizer)
        if problems:
            raise ValueError("dmuon.capture.cuda_graphs: this DMuon's step cannot be captured: " + "; ".join(problems))
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"dmuon.capture.cuda_graphs: warmup_steps must be an int >= 1, got {warmup_steps!r}")
        self.optimizer, self.warmup_steps, self._pool = optimizer, warmup_steps, pool
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._guard: ReplayGuard | None = None  # what each replay must still find (held for it)
        self._tally: ReplayTally | None = None  # the replays' statuses, counted on the device

    def step(self) -> None:
        """One optimizer step: eager during the warm-up, then the graph."""
        if self.graph is None:
            self._check_grads()
            if self.eager_steps < self.warmup_steps or self._last_status_failed():
                self._eager_step()  # an error the last status holds is raised by it, as eagerly
                return
            self._capture()
        self._guard.check()
        self.graph.replay()

    @property
    def pool(self) -> Any:
        """The memory pool this step's graph was captured into (after the capture; before, the
        pool it was given): pass it as ``pool=`` to another CapturedStep to share it."""
        return self.graph.pool() if self.graph is not None else self._pool

    def check(self) -> None:
        """Wait for the replays so far and raise the error the first one with an error found (as
        the next eager ``step()`` would); count their skipped steps (``DMuon.skipped_steps``).
        Each replay is counted once, however often this is called."""
        torch.cuda.current_stream().synchronize()
        status = self.optimizer.phases.grad_status
        settle_last_step(self.optimizer)  # the eager steps' last status
        error = status.take_held()
        if self._tally is not None:
            error = status.count_replays(self._tally) or error
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
        process group is destroyed. A later ``step()`` captures again. The skipped steps of its
        replays not yet counted by :meth:`check` are counted now; an error is dropped."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.optimizer.phases.grad_status.count_replays(self._tally)
            self.graph.reset()
        self.graph, self._guard, self._tally = None, None, None
        self.eager_steps = 0

    def _check_device(self) -> None:
        problem = device_problem(local_of(self.optimizer.param_groups[0]["params"][0]).device,
                                 torch.cuda.current_device())
        if problem is not None:
            raise RuntimeError(f"dmuon.capture.cuda_graphs: {problem}")

    def _eager_step(self) -> None:
        self._check_device()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):  # warm-up on a side stream, as torch's capture recipe does
                self.optimizer.step()
        finally:  # joined whatever happens: the caller's next kernels must not race the side stream's
            torch.cuda.current_stream().wait_stream(side)
        self.eager_steps += 1

    def _capture(self) -> None:
        # A number written to lr or weight_decay becomes a device tensor now: inside the
        # capture its host-to-device copy would fail it.
        place_on_device(self.optimizer.param_groups)
        self._check_device()  # before the tally starts: a refusal leaves nothing begun
        status = self.optimizer.phases.grad_status
        status.start_tally(local_of(self.optimizer.param_groups[0]["params"][0]).device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: only this thread's unsafe CUDA calls fail the capture; in the
            # global mode another thread's (a pin-memory thread, a profiler, NCCL's watchdog:
            # pytorch #104487) would invalidate it.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self.optimizer.step()  # recorded, not run: the replay that follows runs it
        finally:
            tally = status.end_tally()
        self.graph, self._guard, self._tally = graph, ReplayGuard(self.optimizer), tally

    def _check_grads(self) -> None:
        missing = [self.optimizer.param_name(p) for g in self.optimizer.param_groups for p in g["params"]
                   if p.grad is None]
        if missing:
            raise ValueError(f"dmuon.capture.cuda_graphs: no grad for {missing[:3]}{' ...' if len(missing) > 3 else ''}"
                             ": a captured step reads every grad where it is; give every parameter a grad and zero "
                             "them with zero_grad(set_to_none=False)")
