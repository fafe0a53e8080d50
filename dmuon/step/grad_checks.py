"""The first phase of a step: this rank's own problems with its grads, found on the host before
the step's first collective, and only *recorded*, never raised there (the step raises them at
its end, after every collective, so no rank waits for one that raised).

A grad is usable when it is laid out exactly like its parameter: same type (DTensor or plain),
dtype, device, global shape and, for a DTensor, the same mesh, placements and local shape; or
replicated where the parameter is sharded (TorchTitan's tensor-parallel embedding: cut locally, no
collective); or, for a parameter replicated on every dim of its mesh (TorchTitan's sequence-parallel
norms), a ``Partial`` sum (summed by every rank alike: ``dmuon.exchange.replicated_grads``). A grad
on another mesh, or placed any other way, is a problem to fix before ``step()``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from dmuon.exchange.replicated_grads import replicated, summable
from dmuon.torch_compat import local_of


def grad_problem(param: torch.Tensor, use_muon: bool) -> str | None:
    """Why ``param.grad`` cannot be used, or None (host facts only: no collective)."""
    grad = param.grad
    if grad.is_sparse or local_of(grad).is_sparse:  # a DTensor says strided whatever its local tensor
        return "sparse gradients are not supported"
    if use_muon and grad.is_complex():
        return "complex gradients are not supported by Muon"
    if grad.dtype != param.dtype:
        return f"gradient dtype {grad.dtype} differs from the parameter's {param.dtype}"
    if grad.shape != param.shape:
        return f"gradient shape {tuple(grad.shape)} differs from the parameter's {tuple(param.shape)}"
    if isinstance(param, DTensor) != isinstance(grad, DTensor):
        return "the parameter and its gradient must both be DTensors or both plain tensors"
    if not isinstance(param, DTensor):
        if grad.device != param.device:
            return f"gradient device {grad.device} differs from the parameter's {param.device}"
        return None
    if grad.device_mesh != param.device_mesh:
        return "its gradient lives on another device mesh than the parameter"
    if grad.placements != param.placements:  # usable where the module docstring says, laid out by usable_grad
        if not (summable(grad) if replicated(param) else all(
                g == p or isinstance(g, Replicate) for g, p in zip(grad.placements, param.placements))):
            return (f"gradient placements {grad.placements} differ from the parameter's {param.placements}: "
                    "reduce it to the parameter's placements on every rank before step() "
                    "(grad.redistribute(param.device_mesh, param.placements)); only a parameter replicated on "
                    "every mesh dim may have a Partial (sum) grad")
        return None
    local_grad, local_param = local_of(grad), local_of(param)
    if local_grad.shape != local_param.shape:
        return (f"gradient local shape {tuple(local_grad.shape)} differs from the parameter's local shard "
                f"{tuple(local_param.shape)}")
    if local_grad.device != local_param.device:
        return f"gradient device {local_grad.device} differs from the parameter's {local_param.device}"
    return None


def step_problems(param_groups: Sequence[dict[str, Any]], name_of: Callable[[torch.Tensor], str],
                  shard_problem: Callable[[Callable[[torch.Tensor], str]], str | None]
                  ) -> tuple[dict[torch.Tensor, str], list[str]]:
    """This rank's own problems with a step: its invalid grads (by parameter) and every problem
    as the message it raises (``shard_problem``: a wrong shard's, or None)."""
    invalid = {p: problem for g in param_groups for p in g["params"]
               if p.grad is not None and (problem := grad_problem(p, g["use_muon"]))}
    problems = [f"parameter {name_of(p)!r}: {why}" for p, why in invalid.items()]
    if shards := shard_problem(name_of):
        problems.append(shards)
    return invalid, problems
