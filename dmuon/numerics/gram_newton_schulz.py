"""Gram Newton-Schulz: the same quintic iteration at fewer flops on rectangular matrices.

For a wide ``X`` (``m x n``, ``m <= n``) every standard iteration ``X <- (a I + b R + c R^2) X``
with ``R = X X^T`` multiplies by ``X`` twice (``4 m^2 n`` flops). Each iteration's factor
``W = a I + b R + c R^2`` is a polynomial in ``R``, so the iteration can stay on ``m x m``
matrices: accumulate ``Q <- Q W`` and ``R <- W R W`` and multiply by ``X`` once at the end
(``X <- Q X``). The result is the same polynomial of ``X`` in exact arithmetic.

In finite precision ``R`` drifts from ``X X^T`` as the iterations compound, so the iteration
*restarts*: after the iterations listed in ``restarts`` it forms ``X <- Q X`` and ``R = X X^T``
afresh (one restart after iteration 2, as in Dao AI Lab's ``gram-newton-schulz`` and its paper,
keeps fp16 as accurate as the standard form).

Cost in units of ``m^3`` with aspect ``a = n / m``: a run of ``k`` iterations between restarts
costs ``4 a + 8 k - 6`` (``R``: ``2 a``; ``R^2``: ``2`` per iteration; ``Q W``: ``2`` but for
the first; ``W R W``: ``4`` but for the last; ``Q X``: ``2 a``), so 5 iterations with one
restart cost ``8 a + 28`` against the standard ``20 a + 10``: Gram is cheaper above
``a = 1.5``. This module holds the iteration and its flops; :mod:`dmuon.numerics.newton_schulz`
decides when it runs and in which dtype."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.torch_compat import mkldnn_fp16_supported

# Iteration counts after which Gram Newton-Schulz rebuilds X and R from scratch (the paper's
# and the reference implementation's default: once, after iteration 2).
DEFAULT_GRAM_RESTARTS: tuple[int, ...] = (2,)

# How Newton-Schulz iterates (``DMuon(ns_algorithm=...)``): "standard" is torch.optim.Muon's
# iteration, bit for bit; "gram" is :mod:`dmuon.numerics.gram_newton_schulz` on every unit;
# "auto" runs Gram on a unit where it costs fewer flops (aspect above 1.5 with the default
# restart) and its dtype runs as fast as the standard one's (:func:`gram_runs_as_fast`).
STANDARD, GRAM, AUTO = "standard", "gram", "auto"
NS_ALGORITHMS = (STANDARD, GRAM, AUTO)
DEFAULT_NS_ALGORITHM = STANDARD


def segment_lengths(steps: int, restarts: Sequence[int]) -> list[int]:
    """The iterations of each run between restarts; restarts at 0 or at/after the last
    iteration change nothing and are dropped."""
    cuts = sorted({r for r in restarts if 0 < r < steps})
    bounds = [0, *cuts, steps]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def gram_flops(m: int, n: int, steps: int, restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> int:
    """Flops of :func:`gram_iterate` on one ``m x n`` matrix (``m <= n``)."""
    return sum(4 * m * m * n + (8 * k - 6) * m * m * m for k in segment_lengths(steps, restarts))


def gram_iterate(
    x: torch.Tensor, schedule: Sequence[tuple[float, float, float]], restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS
) -> torch.Tensor:
    """The quintic iteration with ``schedule``'s ``(a, b, c)`` on a normalized wide matrix
    ``x`` (``rows <= cols``; a transposed view is fine), in Gram form; returns a new tensor of
    ``x``'s dtype. ``x`` is not modified."""
    cuts = set(restarts)
    q: torch.Tensor | None = None  # the product of this run's W's; None right after a (re)start
    gram = x @ x.T
    for i, (a, b, c) in enumerate(schedule):
        if q is not None and i in cuts:
            x = q @ x
            gram = x @ x.T
            q = None
        w = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b R + c R^2
        w.diagonal().add_(a)  # W = a I + b R + c R^2
        q = w if q is None else q @ w
        if i + 1 < len(schedule) and i + 1 not in cuts:
            gram = w @ (gram @ w)  # R of W X; W is a polynomial in R, so W R W
    assert q is not None, "an empty schedule"
    return q @ x


def standard_flops(m: int, n: int, steps: int) -> int:
    """Flops of the standard iteration on one ``m x n`` matrix (``m <= n``): per step ``X X^T``
    2 m^2 n, ``b S + c S S`` 2 m^3, the product with ``X`` 2 m^2 n."""
    return steps * (4 * m * m * n + 2 * m * m * m)


def gram_dtype(ns_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype Gram Newton-Schulz multiplies in where the standard iteration would use
    ``ns_dtype``: fp32 stays fp32; in place of bf16, fp16 where fp16 matmul runs at hardware
    speed (every accelerator; CPUs with a oneDNN fp16 GEMM), since Gram's accumulated ``Q`` and
    ``R`` drift in bf16's 8-bit mantissa (docs/optimizer.md has the measurements), and fp32 on
    other CPUs (their fp16 GEMM is a slow fallback). fp32 and fp64 stay as asked (fp64 must
    never become fp16 on a CPU with an fp16 GEMM)."""
    if ns_dtype in (torch.float32, torch.float64):
        return ns_dtype
    if device_type != "cpu" or mkldnn_fp16_supported():
        return torch.float16
    return torch.float32


def gram_runs_as_fast(ns_dtype: torch.dtype, device_type: str) -> bool:
    """Whether :func:`gram_dtype` multiplies as fast as ``ns_dtype`` on this kind of device
    (fp16 beside bf16 on accelerators, the same dtype): only then do Gram's fewer flops make it
    faster, so only then does ``ns_algorithm="auto"`` pick it."""
    chosen = gram_dtype(ns_dtype, device_type)
    return chosen == ns_dtype or (chosen == torch.float16 and ns_dtype == torch.bfloat16)


def uses_gram(algorithm: str, shape: Sequence[int], steps: int,
              restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> bool:
    """Whether a unit of matrix ``shape`` runs Gram Newton-Schulz under ``algorithm`` (for
    "auto": where Gram costs fewer flops, a pure function of the shape, so that an owner and a
    single process decide alike)."""
    if algorithm != AUTO:
        return algorithm == GRAM
    m, n = sorted(shape[-2:])
    return gram_flops(m, n, steps, restarts) < standard_flops(m, n, steps)


def resolve_ns_algorithm(algorithm: str, ns_dtype: torch.dtype, device_type: str) -> str:
    """``algorithm`` as it runs with ``ns_dtype`` on a device of ``device_type``: "auto"
    becomes "standard" where Gram's dtype is slower than ``ns_dtype``
    (:func:`gram_runs_as_fast`: a CPU with a bf16 but no fp16 GEMM)."""
    if algorithm == AUTO and not gram_runs_as_fast(ns_dtype, device_type):
        return STANDARD
    return algorithm
