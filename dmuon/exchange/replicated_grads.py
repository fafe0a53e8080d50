"""Grads of replicated parameters, summed by collectives the plan decides for every rank.

A DTensor parameter replicated on every dim of its mesh (a norm's weight under tensor
parallelism) may get its grad as a ``Partial`` sum (sequence parallelism: each rank
holds its tokens' share) or already ``Replicate``. Each rank sees only its own grad, so
"reduce where the grad is Partial" would be a collective some ranks run and others skip
(a hang on NCCL, a size mismatch on gloo). Instead the plan names these parameters once
(from placements alone) and every rank sums each one's grad at every step, one
``all_reduce`` per mesh dim, whatever its grad looks like:

- a ``Partial`` grad sends its local value (DTensor's own reduction, the same bits);
- a ``Replicate`` grad is sent by the mesh dim's first rank, the others send ``-0.0``
  (``x + -0.0`` is ``x`` for every ``x``, ``-0.0`` and NaN included, so the sum is the
  grad's own bits);
- a missing or unusable grad sends ``-0.0`` (the step's status masks what it would do).

Ranks that disagree on a parameter (``Partial`` on some, ``Replicate`` on others) are
counted in the step's status (``dmuon.exchange.grad_status``). The cost: one small
``all_reduce`` per replicated parameter and mesh dim per step, also where the grads were
already replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from dmuon.torch_compat import local_of


def replicated(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor replicated on every dim of its mesh (its grad may be
    ``Partial``)."""
    return isinstance(param, DTensor) and all(isinstance(p, Replicate) for p in param.placements)


def partial_grad(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a ``Partial`` sum on some mesh dim."""
    return isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements)


def summable(grad: DTensor) -> bool:
    """Whether every dim of ``grad`` is ``Replicate`` or a ``Partial`` sum (the two this
    module sums exactly)."""
    return all(isinstance(p, Replicate) or isinstance(p, Partial) and p.reduce_op == "sum" for p in grad.placements)


def sum_replicated_grads(params: Sequence[DTensor], usable: Callable[[torch.Tensor], bool]) -> dict[DTensor, DTensor]:
    """Each replicated parameter's grad, summed over its mesh and laid out like it
    (``Replicate`` everywhere); the same collectives on every rank, in ``params``' order.
    ``usable``: whether this rank's grad passed the local checks."""
    summed: dict[DTensor, DTensor] = {}
    for param in params:
        grad = param.grad if usable(param) else None
        mesh = param.device_mesh
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        if grad is None:
            value = torch.full_like(local_of(param), -0.0)
        else:
            value = local_of(grad).clone()  # the caller's grad stays as it was
        for dim in range(mesh.ndim):
            if mesh.size(dim) == 1:
                continue
            kind = None if grad is None else grad.placements[dim]
            if not isinstance(kind, Partial) and coordinate[dim] != 0:
                value.fill_(-0.0)  # a Replicate (or missing) grad is sent once, from the dim's first rank
            dist.all_reduce(value, group=mesh.get_group(dim))
        if grad is not None:
            summed[param] = DTensor.from_local(value, mesh, param.placements, run_check=False,
                                               shape=param.shape, stride=param.stride())
    return summed
