"""One ``DMuon``'s step as the phases of one object, :class:`Step`, made for each step by
:meth:`StepPhases.prepare` and holding what its phases share; :class:`StepPhases` holds what
lasts between steps (the paths and the owner plan, the status channel, the host changes a
masked step takes back, QK-clip, the telemetry, the communication counters). ``DMuon.step``
calls them in order::

    step = phases.prepare(...)   # the plan (once); the last step's status read
    step.check_locally()         # 1. host facts only: nothing changes
    step.agree()                 # 2. the status sums start (one device all_reduce)
    step.wait()                  # 3. the one wait: the masks are made
    step.compute_and_apply()     # 4. every update, under the masks
    step.report()                # 5. telemetry; the step's first error raised

The order is what the step's guarantees rest on (docs/architecture.md, "What a step guarantees"):
nothing collective or state-changing before the status is agreed, every collective on every rank
whatever its grads, every error raised after the last collective. The wait in phase 3 is a stream
wait on an accelerator (no host read); on the CPU (gloo) the host waits there for the sums."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dmuon.step.adamw_part import adamw_part
from dmuon.attention.clipping import AttentionClip, muon_group_threshold
from dmuon.exchange.comm import CommStats, ScratchMeter
from dmuon.exchange.grad_status import GradStatus, usable_grad
from dmuon.exchange.status_masks import StatusMasks, StepMask
from dmuon.step.fast_path import FastPath
from dmuon.step.grad_checks import step_problems
from dmuon.step.group_steps import GroupSteps
from dmuon.state.kept_state import MomentumDtypes
from dmuon.numerics.finite import all_finite
from dmuon.options.param_groups import muon_groups as param_muon_groups
from dmuon.state.rollback import StateRollback
from dmuon.step.telemetry import Telemetry
from dmuon.torch_compat import local_of

ParamGroups = list[dict[str, Any]]
NameOf = Callable[[torch.Tensor], str]


@dataclass
class LocalChecks:
    """What this rank knows before the step's first collective (host facts only)."""

    pending: Exception | None
    """The error every rank raises alike at the end of this step (the last step's status or
    QK-clip's reports showed a problem), or None; this step is then masked everywhere."""
    invalid: dict[torch.Tensor, str]
    """This rank's unusable grads, with the reason."""
    problems: list[str]
    """This rank's own problems, as the messages it raises at the end of this step."""
    thresholds: list[float | None]
    """QK-clip's threshold of each registered attention."""

    def has_usable_grad(self, param: torch.Tensor) -> bool:
        return param.grad is not None and param not in self.invalid

    def errors(self, failure: Exception | None) -> list[Exception]:
        """The step's errors, the one every rank shares first."""
        own = ValueError(f"DMuon: {self.problems[0]}") if self.problems else None
        return [e for e in (self.pending, own, failure) if e is not None]


@dataclass(frozen=True)
class StepOptions:
    """The optimizer-wide options the phases read, as ``DMuon`` holds them at this step."""

    ns_dtype: str
    skip_nonfinite: bool
    foreach: bool | None
    fused: bool | None


class StepPhases:
    """One ``DMuon``'s step, phase by phase, and everything the phases keep between steps."""

    def __init__(self, fast_path: FastPath, telemetry: Telemetry) -> None:
        self.fast_path = fast_path
        self.telemetry = telemetry
        self.comm_stats = CommStats()  # bytes and collectives of the fast path since construction
        self.scratch_stats = ScratchMeter()  # live and peak bytes of its scratch (peak reset each step)
        self.attention_clip = AttentionClip()
        self.grad_status = GradStatus()
        self.rollback = StateRollback()
        self.plan_signature: tuple | None = None  # what the plan was made for (:meth:`prepare`)
        self.momentum_dtypes = MomentumDtypes()  # what the momenta are held for (a group's edit converts them)

    def forget_plan(self) -> None:
        """Paths, plan and status channel: made again at the next step (the parameters changed)."""
        self.fast_path.forget()
        self.grad_status.forget()

    def replay_buffers(self) -> tuple[Any, ...]:
        """What holds device memory a step made once and every later step reads (the owner
        plan's run, the status channel): a CUDA graph of the step holds these while it may
        replay, so that a :meth:`forget_plan` (a load) frees nothing a replay reads."""
        return self.fast_path.owner_run, self.grad_status.channel

    def paths(self, param_groups: ParamGroups, name_of: NameOf) -> dict[torch.Tensor, str]:
        """Each Muon parameter's path (``dmuon.plan.paths``), made once."""
        return self.fast_path.paths(list(param_muon_groups(param_groups)), name_of)

    # --------------------------------------------------------------- before the phases

    def prepare(self, param_groups: ParamGroups, state: dict[torch.Tensor, dict[str, Any]], name_of: NameOf,
                device: torch.device, options: StepOptions) -> Step:
        """This step, after making the paths, the owner plan and the status channel (at the
        first step, and again when the parameters or a Muon group's Newton-Schulz settings
        changed: a direct edit of ``param_groups``, ``load_state_dict``; no collective but the
        groups a plan may make), reading the last step's error from its status (its host
        changes taken back if it was masked) and converting the momenta of a group whose
        ``momentum_dtype`` was edited since."""
        signature = plan_signature(param_groups)
        if signature != self.plan_signature:
            self.forget_plan()
            self.plan_signature = signature
        muon_groups = param_muon_groups(param_groups)
        self.fast_path.plan(muon_groups, name_of)
        self.grad_status.plan([p for g in param_groups for p in g["params"]], name_of)
        last_error = self.grad_status.take_pending()
        if self.grad_status.last_masked:  # an error, or a non-finite grad skipped (skip_nonfinite)
            self.rollback.undo()
        else:
            self.rollback.keep()
        self.momentum_dtypes.check(param_groups, state, name_of)
        return Step(self, param_groups, state, name_of, device, options, muon_groups, last_error)


class Step:
    """One step in flight, its phases as methods: what :meth:`StepPhases.prepare` found, and
    what each phase leaves the next (this rank's checks, the status masks, AdamW's failure)."""

    def __init__(self, phases: StepPhases, param_groups: ParamGroups, state: dict[torch.Tensor, dict[str, Any]],
                 name_of: NameOf, device: torch.device, options: StepOptions,
                 muon_groups: dict[torch.Tensor, dict[str, Any]], last_error: Exception | None) -> None:
        self.phases, self.param_groups, self.state, self.name_of = phases, param_groups, state, name_of
        self.device, self.options = device, options
        self.muon_groups = muon_groups  # each Muon parameter's group, in order
        self.last_error = last_error  # the last step's error, read from its status (every rank raises it alike)
        self.checked: LocalChecks | None = None  # phase 1's findings
        self.status: StatusMasks | None = None  # phase 2's sums in flight; the masks once phase 3 waited for them
        self.failure: Exception | None = None  # what torch's AdamW raised in phase 4 (phase 5 raises it)

    def check_locally(self) -> None:
        """Phase 1, host facts only, nothing changed: the error every rank raises alike (the
        last step's, or QK-clip's reports), this rank's own problems, and QK-clip's thresholds
        (a configuration error raises here, on every rank alike, before any collective)."""
        clip = self.phases.attention_clip
        thresholds = clip.thresholds(muon_group_threshold(self.muon_groups, self.name_of))
        pending = self.last_error or clip.take_pending()
        invalid, problems = step_problems(self.param_groups, self.name_of, self.phases.fast_path.shard_problem)
        self.checked = LocalChecks(pending, invalid, problems, thresholds)

    def agree(self) -> None:
        """Phase 2: start summing every rank's status (one asynchronous device ``all_reduce``):
        which DTensor parameters have a usable grad, whether a rank found a problem, and with
        ``skip_nonfinite`` whether a grad holds a NaN or inf (checked on the device)."""
        checked, grad_status = self.checked, self.phases.grad_status
        finite = None
        if self.options.skip_nonfinite:
            grads = [local_of(p.grad) for g in self.param_groups for p in g["params"] if checked.has_usable_grad(p)]
            finite = all_finite(grads, grad_status.device or self.device)  # where the status is summed
        self.status = grad_status.agree(checked.has_usable_grad, bool(checked.problems), checked.pending is not None,
                                        self.device, finite)

    def wait(self) -> None:
        """Phase 3, the one wait of the step: the status sums are in and the masks made (on an
        accelerator a stream wait, no host read); the sums go to the host for the next step."""
        self.status.wait()

    def compute_and_apply(self) -> None:
        """Phase 4: every update of the step under the masks, the same collectives on every
        rank whatever they say: the replicated grads summed, the AdamW part, Muon on each path,
        QK-clip. What torch's AdamW raised is kept for phase 5."""
        phases, status, checked, options = self.phases, self.status, self.checked, self.options
        telemetry, state = phases.telemetry, self.state
        telemetry.begin_step(self.device, phases.comm_stats.bytes_sent)
        steps = GroupSteps(options.ns_dtype, phases.comm_stats, telemetry, options.foreach, options.fused)
        summed = phases.grad_status.sum_replicated(checked.has_usable_grad)  # on every rank, whatever its grads
        grads = {p: usable_grad(p, summed) for p in self.muon_groups if checked.has_usable_grad(p)}
        self.failure = adamw_part(self.param_groups, state, status, telemetry, options.foreach, options.fused,
                                  phases.rollback, summed, self.name_of)
        if self.failure is not None and status.mask is not StepMask.MASKED and status.alone:
            status.mask_here()  # the Muon part stays as it is too
        if status.mask is not StepMask.MASKED:
            steps.make_muon_state(grads, self.muon_groups, state, phases.rollback, self.name_of)
        phases.scratch_stats.reset_peak()
        phases.fast_path.step(grads, status, self.muon_groups, state, steps, phases.comm_stats, phases.scratch_stats)
        steps.muon_off_the_fast_path(self.param_groups, phases.paths(self.param_groups, self.name_of), grads, status,
                                     state)
        step_ok = None if status.mask is StepMask.STANDS else status.step_ok
        if clip := phases.attention_clip.step(checked.thresholds, step_ok):
            telemetry.qk_clip(clip.largest, clip.clipped_heads)

    def report(self) -> None:
        """Phase 5: the telemetry's figures of the step, then its first error, raised here
        after every collective of the step (the same on every rank where it is shared)."""
        errors = self.checked.errors(self.failure)
        self.phases.telemetry.end_step(self.phases.comm_stats.bytes_sent, complete=not errors)
        if errors:
            raise errors[0]


def plan_signature(param_groups: ParamGroups) -> tuple:
    """What the plan is made from besides the parameters' shapes and placements: which
    parameters each group holds and a Muon group's Newton-Schulz settings (the units it cuts
    and the work it balances)."""
    return tuple((g["use_muon"], tuple(map(id, g["params"])), *(
        (g["ns_steps"], g["split_rows"], g["ns_algorithm"], tuple(g["ns_gram_restarts"])) if g["use_muon"] else ()))
        for g in param_groups)
