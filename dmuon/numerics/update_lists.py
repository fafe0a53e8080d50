"""The elementwise rules of ``dmuon.numerics.update_rules`` over lists of tensors.

With ``foreach`` each rule is one ``torch._foreach_*`` op per device and dtype
signature of its tensors (as torch.optim's foreach path groups them), so a step's
host work and kernel launches do not grow with the parameter count; without it, the
per-tensor rule in a loop. Both give the same bits: each foreach op computes what
its per-tensor op computes (``_foreach_lerp_`` is ``lerp_``, ``_foreach_mul_`` by a
number is ``mul_`` by that number, ``_foreach_add_(alpha=)`` is ``add_(alpha=)``, in
the same opmath), which ``tests/test_update_lists.py`` checks bit for bit.

Callers pass plain tensors (a DTensor's local tensor): a foreach op on DTensors
would pay DTensor's dispatch per op and refuse lists spanning meshes.

A Tensor ``lr`` steps per tensor, as ``torch.optim.Muon`` does: its arithmetic makes
0-dim tensors that a foreach op could place differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.numerics.update_rules import apply_muon_update_, cautious_decay_, nesterov_lookahead
from dmuon.torch_compat import default_foreach

Tensors = Sequence[torch.Tensor]


def resolve_foreach(foreach: bool | None, device: torch.device) -> bool:
    """``foreach`` as given, or for ``None`` torch's default for ``device`` (foreach on
    CUDA, per tensor on CPU), as torch.optim decides it."""
    return default_foreach(device) if foreach is None else foreach


def by_signature(*lists: Tensors) -> list[list[int]]:
    """Indices of the tensors whose entries in every list share device and dtype: the
    lists a foreach op takes its fast path on. In first-seen order."""
    dtypes = [[t.dtype for t in tensors] for tensors in lists]
    devices = [[t.device for t in tensors] for tensors in lists]
    if all(facts.count(facts[0]) == len(facts) for facts in (*dtypes, *devices) if facts):
        return [list(range(len(lists[0])))] if lists[0] else []  # the usual case, read without a key per tensor
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(*dtypes, *devices)):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def momentum_(bufs: Tensors, grads: Tensors, momentum: float, foreach: bool) -> None:
    """``buf = lerp(buf, grad, 1 - momentum)`` for every pair, in place."""
    if not foreach:
        for buf, grad in zip(bufs, grads):
            buf.lerp_(grad, 1 - momentum)
        return
    for idx in by_signature(bufs, grads):
        torch._foreach_lerp_([bufs[i] for i in idx], [grads[i] for i in idx], 1 - momentum)


def lookahead(grads: Tensors, bufs: Tensors, momentum: float, nesterov: bool, foreach: bool) -> list[torch.Tensor]:
    """:func:`~dmuon.numerics.update_rules.nesterov_lookahead` of every pair (after
    :func:`momentum_`): new tensors with Nesterov, the buffers themselves without."""
    if not (foreach and nesterov):
        return [nesterov_lookahead(grad, buf, momentum, nesterov) for grad, buf in zip(grads, bufs)]
    out: list[torch.Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for idx in by_signature(grads, bufs):
        for i, result in zip(idx, torch._foreach_lerp([grads[i] for i in idx], [bufs[i] for i in idx], momentum)):
            out[i] = result
    return out


def apply_muon_updates_(
    params: Tensors, orthos: Tensors, lr: float | torch.Tensor, weight_decay: float, scale: float,
    cautious_weight_decay: bool, foreach: bool,
) -> None:
    """:func:`~dmuon.numerics.update_rules.apply_muon_update_` of every pair (``params`` of one
    group and one shape scale): the decay, then the scaled step."""
    if not foreach or isinstance(lr, torch.Tensor):
        for param, ortho in zip(params, orthos):
            apply_muon_update_(param, ortho, lr, weight_decay, scale, cautious_weight_decay)
        return
    for idx in by_signature(params, orthos):
        targets, steps = [params[i] for i in idx], [orthos[i] for i in idx]
        if cautious_weight_decay:
            for target, step in zip(targets, steps):  # its mask is a torch.where per tensor
                cautious_decay_(target, step, lr, weight_decay)
        elif weight_decay != 0:  # x * 1.0 is x: skipping the op keeps the bits
            torch._foreach_mul_(targets, _decay_factor(1 - lr * weight_decay, targets[0]))
        torch._foreach_add_(targets, steps, alpha=-lr * scale)


def _decay_factor(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as the number ``mul_`` by a Python float multiplies with (fp32; fp64 for
    fp64 tensors), held in a 0-dim **CPU** tensor, whatever ``like``'s device.

    Both alternatives lose bits on a bf16 (or fp16) list. ``_foreach_mul_`` by a plain
    number rounds it to the list's dtype on the CPU (0.998 -> 0.99609375, about twice the
    decay at lr 0.02, wd 0.1). A 0-dim fp32 tensor on the GPU is worse: CUDA's
    ``_foreach_mul_`` falls back to one ``mul_`` per tensor for a scalar of another dtype,
    and that ``mul_`` reads a non-CPU operand as the tensor's own dtype. A CPU scalar
    tensor is what both devices read exactly: CUDA's ``_foreach_mul_`` passes its value
    to the multi-tensor kernel as an fp32 opmath number (one launch, no device sync: the
    value is already on the host), and the CPU computes ``mul_`` with it in fp32."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.tensor(value, dtype=dtype)
