"""The phases of ``DMuon.step`` after planning: check locally, then (after the status is
agreed) compute and apply. Each phase is one function with one job, so a reader can
audit the order the step's guarantees depend on (docs/architecture.md, "What a step
guarantees"): nothing collective or state-changing before the status agrees, every
collective on every rank whatever its grads, every error raised after the last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dmuon.adamw_part import adamw_part
from dmuon.attention.clipping import muon_group_threshold
from dmuon.exchange.grad_status import usable_grad
from dmuon.exchange.status_masks import StatusMasks
from dmuon.grad_checks import step_problems
from dmuon.group_steps import GroupSteps
from dmuon.param_groups import muon_groups as param_muon_groups
from dmuon.numerics.finite import all_finite
from dmuon.torch_compat import local_of

if TYPE_CHECKING:
    from dmuon.optimizer import DMuon


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


def plan(optimizer: DMuon) -> dict[torch.Tensor, dict[str, Any]]:
    """Each Muon parameter's group, after making the paths, the owner plan and the status
    channel at the first step, and again when the parameters or a Muon group's Newton-Schulz
    settings changed (a direct edit of ``param_groups``, ``load_state_dict``); no collective
    but the groups a plan may make."""
    signature = plan_signature(optimizer.param_groups)
    if signature != optimizer._plan_signature:
        optimizer._forget_plan()
        optimizer._plan_signature = signature
    muon_groups = param_muon_groups(optimizer.param_groups)
    optimizer._fast_path.plan(muon_groups, optimizer.param_name)
    optimizer._grad_status.plan([p for g in optimizer.param_groups for p in g["params"]], optimizer.param_name)
    return muon_groups


def plan_signature(param_groups: list[dict[str, Any]]) -> tuple:
    """What the plan is made from besides the parameters' shapes and placements: which
    parameters each group holds and a Muon group's Newton-Schulz settings (the units it cuts
    and the work it balances)."""
    return tuple((g["use_muon"], tuple(map(id, g["params"])), *(
        (g["ns_steps"], g["split_rows"], g["ns_algorithm"], tuple(g["ns_gram_restarts"])) if g["use_muon"] else ()))
        for g in param_groups)


def check_locally(optimizer: DMuon, muon_groups: dict[torch.Tensor, dict[str, Any]]) -> LocalChecks:
    """The error the last step's sums and QK-clip's reports show (the same on every rank;
    the last step's host changes taken back if it was masked), this rank's own problems,
    and QK-clip's thresholds (a configuration error raises here, on every rank alike,
    before any collective)."""
    thresholds = optimizer._attention_clip.thresholds(muon_group_threshold(muon_groups, optimizer.param_name))
    masked = optimizer._grad_status.take_pending()
    if optimizer._grad_status.last_masked:  # an error, or a non-finite grad skipped (skip_nonfinite)
        optimizer._rollback.undo()
    else:
        optimizer._rollback.keep()
    pending = masked or optimizer._attention_clip.take_pending()
    invalid, problems = step_problems(optimizer.param_groups, optimizer.param_name,
                                      optimizer._fast_path.shard_problem)
    return LocalChecks(pending, invalid, problems, thresholds)


def finite_grads(optimizer: DMuon, checked: LocalChecks) -> torch.Tensor | None:
    """With ``skip_nonfinite``: whether every usable grad on this rank is finite (a 0-dim
    device bool, ``dmuon.numerics.finite``), summed into the step's status; else None."""
    if not optimizer.skip_nonfinite:
        return None
    grads = [local_of(p.grad) for g in optimizer.param_groups for p in g["params"] if checked.has_usable_grad(p)]
    return all_finite(grads, optimizer._grad_status.device or optimizer._device())  # where the status is summed


def compute_and_apply(optimizer: DMuon, muon_groups: dict[torch.Tensor, dict[str, Any]], checked: LocalChecks,
                      status: StatusMasks) -> Exception | None:
    """Every update of the step under the status's masks, the same collectives on every
    rank whatever they say; what torch's AdamW raised is returned."""
    telemetry = optimizer._telemetry
    telemetry.begin_step(optimizer._device(), optimizer.comm_stats.bytes_sent)
    steps = GroupSteps(optimizer.ns_dtype, optimizer.comm_stats, telemetry, optimizer.foreach, optimizer.fused)
    summed = optimizer._grad_status.sum_replicated(checked.has_usable_grad)  # on every rank, whatever its grads
    grads = {p: usable_grad(p, summed) for p in muon_groups if checked.has_usable_grad(p)}
    failure = adamw_part(optimizer.param_groups, optimizer.state, status, telemetry, optimizer.foreach,
                         optimizer.fused, optimizer._rollback, summed)
    if failure is not None and status.host_ok is not False and status.alone:  # the Muon part stays as it is too
        status.mask_here()
    if status.host_ok is not False:
        steps.make_muon_state(grads, muon_groups, optimizer.state, optimizer._rollback)
    optimizer.scratch_stats.reset_peak()
    optimizer._fast_path.step(grads, status, muon_groups, optimizer.state, steps, optimizer.comm_stats,
                              optimizer.scratch_stats)
    steps.muon_off_the_fast_path(optimizer.param_groups, optimizer._paths(), grads, status, optimizer.state)
    status.finish()  # the sums go to the host for the next step even where no mask was read
    if clip := optimizer._attention_clip.step(checked.thresholds, None if status.host_ok else status.step_ok):
        telemetry.qk_clip(clip.largest, clip.clipped_heads)
    return failure
