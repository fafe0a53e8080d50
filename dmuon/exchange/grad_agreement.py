"""Before a step touches anything: is every grad usable, and do all ranks agree?

A step's collectives depend on which parameters have a grad. If ranks disagree (a
grad missing on one rank), or one rank must reject a grad, the others would wait in a
collective forever. So every rank checks its own grads, then one small sum per mesh
tells every rank the same counts, and every rank raises the same error or none does.

Whether a grad exists and whether it is usable are host facts (Python objects, shapes,
types), so the sum runs on the host (``dmuon.exchange.groups.sum_on_host``): no device value is
read, and the step does not wait for the backward's kernels to finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dmuon.exchange.groups import host_group_of, sum_on_host
from dmuon.plan.mesh_facts import mesh_ranks


def grad_problem(param: torch.Tensor, use_muon: bool) -> str | None:
    """Why ``param.grad`` cannot be used, or None."""
    grad = param.grad
    if grad.is_sparse:
        return "sparse gradients are not supported"
    if not use_muon:
        return None
    if grad.is_complex():
        return "complex gradients are not supported by Muon"
    if grad.shape != param.shape:
        return f"gradient shape {tuple(grad.shape)} differs from the parameter's {tuple(param.shape)}"
    if isinstance(param, DTensor) != isinstance(grad, DTensor):
        return "the parameter and its gradient must both be DTensors or both plain tensors"
    return None


def agree_on_grads(
    by_mesh: dict[DeviceMesh, list[torch.Tensor]],
    problems: dict[torch.Tensor, str],
    name_of: Callable[[torch.Tensor], str],
) -> None:
    """One host sum per mesh: every rank must see the same distributed grads.

    Counts, per DTensor Muon parameter, the ranks that have a grad and the ranks that
    have none, plus the ranks that found an invalid grad anywhere. A parameter is
    uneven when both counts are non-zero (counting both sides, rather than comparing
    one with the mesh size, keeps the answer right on a group whose sums are local, as
    the dry run's fake group's are). Every rank runs every mesh's sum before deciding
    anything, and sees the same sums, so every rank raises the same error or none
    does: no rank is left waiting in a collective.
    """
    local_problem = next(iter(problems.items()), None)
    bad_ranks = 0
    uneven: list[str] = []
    for mesh, params in by_mesh.items():
        has = [int(p.grad is not None) for p in params]
        sums = sum_on_host([*has, *(1 - h for h in has), int(local_problem is not None)],
                           host_group_of(mesh_ranks(mesh), [mesh]))
        with_grad, without_grad, bad = sums[: len(params)], sums[len(params) : -1], sums[-1]
        bad_ranks = max(bad_ranks, bad)
        uneven += [name_of(p) for p, yes, no in zip(params, with_grad, without_grad) if yes and no]
    if local_problem:
        param, problem = local_problem
        raise ValueError(f"DMuon: parameter {name_of(param)!r}: {problem}")
    if bad_ranks:
        raise ValueError(f"DMuon: {bad_ranks} rank(s) found an invalid gradient; see their error message")
    if uneven:
        raise RuntimeError(
            f"DMuon: ranks disagree on which parameters have gradients: {uneven} have a grad on "
            "some ranks but not on others. Every rank must produce the same set of grads "
            "(set unused grads to zeros, or to None on every rank)."
        )


def agreed_grads(
    param_groups: list[dict[str, Any]],
    muon_params: Sequence[torch.Tensor],
    name_of: Callable[[torch.Tensor], str],
) -> dict[torch.Tensor, torch.Tensor]:
    """Check every grad and agree on the grad set (:func:`agree_on_grads`); then each Muon
    parameter's grad, laid out like the parameter. Nothing is modified before the
    checks pass, so a rejected step leaves parameters and state as they were."""
    problems = {p: problem for g in param_groups for p in g["params"]
                if p.grad is not None and (problem := grad_problem(p, g["use_muon"]))}
    # DTensor Muon parameters by mesh: their step may run collectives, so every rank of
    # the mesh must agree on their grads (whatever their path).
    by_mesh: dict[DeviceMesh, list[torch.Tensor]] = {}
    for param in muon_params:
        if isinstance(param, DTensor) and param.device_mesh.size() > 1:
            by_mesh.setdefault(param.device_mesh, []).append(param)
    agree_on_grads(by_mesh, problems, name_of)
    grads: dict[torch.Tensor, torch.Tensor] = {}
    for param in (p for p in muon_params if p.grad is not None):
        grad = param.grad
        if isinstance(param, DTensor) and grad.placements != param.placements:
            # A collective; safe here: every rank agreed this grad exists.
            grad = grad.redistribute(param.device_mesh, param.placements)
        grads[param] = grad
    return grads
