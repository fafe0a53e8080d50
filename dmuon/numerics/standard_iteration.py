"""The standard quintic Newton-Schulz iteration (torch.optim.Muon's operations), with its
buffers reused across the matrices of one shape.

A step orthogonalizes hundreds of matrices of a few shapes. Made afresh for each matrix, the
iteration allocates a dozen tensors (the normalized copy, a second iterate, a Gram matrix and a
polynomial per step) and the views its transposes need: host work per matrix that, on small
matrices, costs about as much as the products themselves. Matrices of one shape run back to
back can share one set of buffers (:class:`NewtonSchulzBuffers`): every product writes into its
buffer (``out=``: the kernel a new tensor would get), and each buffer has the layout the new
tensor would have had (contiguous, seen wide), so the bits are the unbuffered iteration's
(``tests/test_standard_iteration.py``). The memory held is never more than the one matrix's
workspace the step's memory bound counts (``dmuon.tools.dry_run.memory_bound``): two iterates,
the Gram matrix and the polynomial (and the bf16 result where the iteration runs wider; how a
result leaves the buffers: ``newton_schulz._result``); the owner releases them after each
batch's Newton-Schulz."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.numerics.alignment import aligned

Triple = tuple[float, float, float]


class IterationBuffers:
    """The standard iteration's buffers for matrices of one shape, dtype and device: the
    normalized update (``first``, in the update's orientation), a second iterate, the Gram
    matrix and the polynomial, with the views the iteration reads made once."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.key = (shape, dtype, device)
        rows, cols = shape
        self.tall = rows > cols
        self.wide = (cols, rows) if self.tall else (rows, cols)
        self.first: torch.Tensor | None = None
        self.second: torch.Tensor | None = None
        self.gram: torch.Tensor | None = None
        self.poly: torch.Tensor | None = None
        self.start: tuple[torch.Tensor, ...] = ()
        self.cycle: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        self.ready()

    def ready(self) -> None:
        """Make the buffers missing (at first, or after :meth:`hand_over` or :meth:`keep_only`)
        and the views the iteration reads: the first iterate and the two it alternates between,
        each with its transpose. A tall update's normalized copy is read transposed in the first
        step (as torch.optim.Muon reads it); after that its storage serves as a contiguous wide
        iterate, as the new tensor the unbuffered iteration would allocate there."""
        if self.start:
            return
        shape, dtype, device = self.key
        if self.first is None:
            self.first = torch.empty(shape, dtype=dtype, device=device)
        if self.second is None:
            self.second = torch.empty(self.wide, dtype=dtype, device=device)
        if self.gram is None:
            self.gram = torch.empty(self.wide[0], self.wide[0], dtype=dtype, device=device)
            self.poly = torch.empty_like(self.gram)
        first_wide = self.first.view(self.wide)
        self.start = (self.first.T, self.first) if self.tall else (self.first, self.first.T)
        self.cycle = ((self.second, self.second.T), (first_wide, first_wide.T))

    def hand_over(self, iterate: torch.Tensor) -> None:
        """``iterate`` (one of these buffers) becomes the caller's result: the buffer is
        dropped, and made again for the next matrix (not now: the peak stays one matrix's)."""
        if iterate is self.second:  # else it is ``first`` or its wide view
            self.second = None
        else:
            self.first = None
        self.start = self.cycle = ()

    def keep_only(self, iterate: torch.Tensor) -> None:
        """Before the result is copied out of ``iterate`` (one of these buffers): drop the
        others, made again for the next matrix, so that the copy's peak is the unbuffered
        iteration's (its other buffers are gone by then)."""
        if iterate is self.second:
            self.first = None
        else:
            self.second = None
        self.gram = self.poly = None
        self.start = self.cycle = ()


class NewtonSchulzBuffers:
    """One set of :class:`IterationBuffers` at a time: made for the shape in hand, replaced
    when the shape changes (the old set is freed first). Run the matrices of one shape back to
    back to reuse it; :meth:`release` it when they are done."""

    def __init__(self) -> None:
        self._held: IterationBuffers | None = None

    def for_matrix(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> IterationBuffers:
        key = (shape, dtype, device)
        if self._held is None or self._held.key != key:
            self._held = None  # freed before the next set is made: one set's memory at a time
            self._held = IterationBuffers(shape, dtype, device)
        self._held.ready()
        return self._held

    def release(self) -> None:
        """Free the set held (a batch's Newton-Schulz is done: its memory goes back before the
        exchange's next buffers are made)."""
        self._held = None


def standard_iterate(update: torch.Tensor, dtype: torch.dtype, safety: float, eps: float,
                     schedule: Sequence[Triple], tall: bool,
                     buffers: NewtonSchulzBuffers | None = None) -> tuple[torch.Tensor, IterationBuffers | None]:
    """torch.optim.Muon's quintic iteration, ``X <- a X + (b S + c S S) X`` with ``S = X X^T``,
    from the normalized ``update`` in ``dtype``, seen wide; returns the last iterate and, when
    it is one of ``buffers``' (a contiguous ``update`` only), the set it belongs to (see
    :meth:`IterationBuffers.hand_over`)."""
    if buffers is None or not update.is_contiguous():
        # On new tensors. Each step writes the next iterate into a buffer it does not read
        # (``out=``: the same product as a new tensor, bit for bit), and the two buffers
        # alternate, so the transposes the Gram matrix reads are made once, not once per step.
        # The normalized copy is held by ``x`` alone, so it is freed after the first step.
        x = normalized(update, dtype, safety, eps)
        x, x_t = (x.T, x) if tall else (x, x.T)
        spare, spare_t = None, None
        for a, b, c in schedule:
            gram = torch.mm(x, x_t)
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            if spare is None:
                spare = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                spare_t = spare.T
            torch.addmm(x, poly, x, beta=a, out=spare)
            reusable = x.is_contiguous()  # the first iterate may be a transposed view: never an ``out``
            x, x_t, spare, spare_t = spare, spare_t, x if reusable else None, x_t if reusable else None
        return x, None
    held = buffers.for_matrix(tuple(update.shape), dtype, update.device)
    # :func:`normalized` written into ``first``: the same norm of the same values, the
    # same division.
    if update.dtype == held.first.dtype:
        source = aligned(update)
        torch.div(source, _norm(source, safety, eps), out=held.first)
        del source  # an aligned copy, not kept through the iteration
    else:
        held.first.copy_(update)  # the widening .to() makes, into a fresh, aligned buffer
        torch.div(held.first, _norm(held.first, safety, eps), out=held.first)
    x, x_t = held.start
    for step, (a, b, c) in enumerate(schedule):
        gram = torch.mm(x, x_t, out=held.gram)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c, out=held.poly)
        following, following_t = held.cycle[step % 2]  # never the iterate it reads
        torch.addmm(x, poly, x, beta=a, out=following)
        x, x_t = following, following_t
    return x, held


def normalized(update: torch.Tensor, dtype: torch.dtype, safety: float, eps: float) -> torch.Tensor:
    """``update`` in ``dtype`` (a new tensor) with every singular value at most 1: the
    Frobenius norm bounds the spectral norm (the same on either orientation)."""
    x = aligned(update.to(dtype))  # .to: no op when already in ``dtype``; the division makes the copy
    return x.div(_norm(x, safety, eps))


def _norm(x: torch.Tensor, safety: float, eps: float) -> torch.Tensor:
    # ``x.norm()`` (torch.optim.Muon's) is this very op behind a Python wrapper of torch.functional.
    norm = torch.linalg.vector_norm(x)
    return norm.clamp(min=eps) if safety == 1.0 else norm * safety + eps  # the first: torch.optim.Muon's, bit for bit
