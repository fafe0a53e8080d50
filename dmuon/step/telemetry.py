"""Per-step figures of a ``DMuon`` step: time, Newton-Schulz time, bytes, update and weight RMS.

``DMuon(..., telemetry=True)`` records, for every ``step()``:

- ``step_s``: wall time of the whole ``step()`` on this rank;
- ``newton_schulz_s``: the part of it spent in Newton-Schulz on this rank;
- ``bytes_sent``: bytes this rank's fast path sent during the step;
- ``muon_update_rms`` / ``adamw_update_rms``: RMS of the weight change ``W_after - W_before``
  (learning rate, shape scale and weight decay included) over every element of the Muon (resp.
  AdamW) parameters, all ranks together;
- ``muon_weight_rms`` / ``adamw_weight_rms``: RMS of the weights after the step, likewise;
- ``max_logit`` / ``qk_clipped_heads``: with QK-clip, the largest attention logit of the step's
  forward passes over every rank (before clipping) and how many heads were clipped
  (``dmuon.attention.clipping``; NaN and 0 without QK-clip). Already reduced by the clip's own
  collective: they cost nothing more.

Cost, and why it stays small:

- the sums of squares are kept on the parameters' device and reduced across ranks with one
  ``all_reduce`` of 6 numbers at the end of ``step()``, issued asynchronously; it is only
  waited for, and copied to the host, when ``telemetry()`` is read (TorchTitan reads it where
  it already synchronizes to print the loss and grad norm);
- the weight change is measured, not modelled, one block at a time: each Muon block (and each
  AdamW group's local shards) is copied before its update and compared after, in place in the
  copy, which is then freed: the extra memory is one block, or the AdamW group's local shards;
  norms are taken in the weights' dtype and summed in float64;
- times come from ``time.perf_counter`` on CPU and from CUDA events on GPU (so no
  synchronization is added during the step; the events are read with the figures).

Which ranks take part: the reduction runs on the default process group, so every rank must step its
``DMuon`` the same number of times (any data- or pipeline-parallel loop does). RMS figures count
each element once per rank that holds it: exact for FSDP (each element on one rank) and single
process; with replicas (HSDP, DDP) a replicated element counts once per copy, which leaves the RMS
unchanged when every element has the same number of copies. Times and bytes are this rank's own."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dmuon.exchange.reductions import start_sum
from dmuon.torch_compat import local_of

# Positions in the vector of sums reduced across ranks.
_MUON_DELTA_SQ, _MUON_WEIGHT_SQ, _MUON_NUMEL, _ADAMW_DELTA_SQ, _ADAMW_WEIGHT_SQ, _ADAMW_NUMEL = range(6)
# What an untimed Newton-Schulz call runs in: a shared no-op context (a generator-based one
# costs microseconds).
_UNTIMED = contextlib.nullcontext()


@dataclass(frozen=True)
class StepFigures:
    """The figures of one ``DMuon.step()`` (see the module docstring for each field)."""

    step_s: float
    newton_schulz_s: float
    bytes_sent: int
    muon_update_rms: float
    muon_weight_rms: float
    adamw_update_rms: float
    adamw_weight_rms: float
    square_sums: tuple[float, ...] = field(repr=False)
    """The reduced sums the RMS come from (squares and element counts), for ``combine``."""
    max_logit: float = math.nan
    qk_clipped_heads: int = 0
    skipped_steps: int = 0
    """Steps ``skip_nonfinite`` skipped so far (``DMuon.skipped_steps``: one step late)."""

    @classmethod
    def from_sums(cls, step_s: float, newton_schulz_s: float, bytes_sent: int, sums: Sequence[float],
                  max_logit: float = math.nan, qk_clipped_heads: int = 0) -> StepFigures:
        def rms(square_sum: float, numel: float) -> float:
            return (square_sum / numel) ** 0.5 if numel else 0.0

        return cls(step_s, newton_schulz_s, bytes_sent, rms(sums[_MUON_DELTA_SQ], sums[_MUON_NUMEL]),
                   rms(sums[_MUON_WEIGHT_SQ], sums[_MUON_NUMEL]), rms(sums[_ADAMW_DELTA_SQ], sums[_ADAMW_NUMEL]),
                   rms(sums[_ADAMW_WEIGHT_SQ], sums[_ADAMW_NUMEL]), tuple(sums), max_logit, qk_clipped_heads)

    @classmethod
    def combine(cls, parts: Sequence[StepFigures]) -> StepFigures:
        """Figures of several optimizers stepped one after the other on this rank (one per
        pipeline stage it holds): times and bytes add up, RMS come from the added sums."""
        return cls.from_sums(
            sum(p.step_s for p in parts), sum(p.newton_schulz_s for p in parts), sum(p.bytes_sent for p in parts),
            [sum(values) for values in zip(*(p.square_sums for p in parts))],
            max((p.max_logit for p in parts if not math.isnan(p.max_logit)), default=math.nan),
            sum(p.qk_clipped_heads for p in parts),
        ).with_skipped(max((p.skipped_steps for p in parts), default=0))

    def with_skipped(self, skipped_steps: int) -> StepFigures:
        """These figures with the optimizer's count of skipped steps."""
        return dataclasses.replace(self, skipped_steps=skipped_steps)


class _Clock:
    """Durations on one device: ``perf_counter`` on CPU, CUDA events on GPU (read later)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: object, end: object) -> float:
        if self.cuda:
            end.synchronize()  # type: ignore[attr-defined]
            return start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]
        return end - start  # type: ignore[operator]


@dataclass
class _StepRecord:
    """What one step recorded: its clock marks, bytes, and the sums being reduced."""

    clock: _Clock
    start: object
    sums: torch.Tensor
    bytes_before: int
    ns_marks: list[tuple[object, object]] = field(default_factory=list)
    end: object = None
    bytes_sent: int = 0
    pending: dist.Work | None = None
    qk_clip: tuple[torch.Tensor, torch.Tensor] | None = None
    """QK-clip's largest logit and clipped-head count (device tensors, read with the figures)."""

    def figures(self) -> StepFigures:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        return StepFigures.from_sums(self.clock.seconds(self.start, self.end),
                                     sum(self.clock.seconds(s, e) for s, e in self.ns_marks), self.bytes_sent,
                                     self.sums.tolist(),
                                     *(() if self.qk_clip is None else (float(self.qk_clip[0]), int(self.qk_clip[1]))))


class Telemetry:
    """What one ``DMuon`` records during a step; disabled, every hook is a no-op."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._current: _StepRecord | None = None  # the step in progress
        self._finished: _StepRecord | None = None  # the last complete step
        self._figures: StepFigures | None = None  # its figures, once read

    def begin_step(self, device: torch.device, bytes_sent_so_far: int) -> None:
        if not self.enabled:
            return
        if self._finished is not None and self._finished.pending is not None:
            # Last step's figures were never read: settle its collective first.
            self._finished.pending.wait()
            self._finished.pending = None
        clock = _Clock(device)
        self._current = _StepRecord(clock, clock.mark(), torch.zeros(6, dtype=torch.float64, device=device),
                                    bytes_sent_so_far)

    def end_step(self, bytes_sent_so_far: int, complete: bool = True) -> None:
        """Start the step's reduction; every ``step()`` calls it, one that raises too, so every
        rank runs the same collectives. A step that raises (``complete=False``) is not
        reported: the last complete step's figures stay."""
        record = self._current
        if record is None:
            return
        record.end = record.clock.mark()
        record.bytes_sent = bytes_sent_so_far - record.bytes_before
        record.pending = start_sum(record.sums)
        self._current = None
        if not complete:
            if record.pending is not None:
                record.pending.wait()  # only on a step that raises: its sums are dropped
            return
        # Figures are made from the record when read, not here: no sync in step().
        self._finished, self._figures = record, None

    def qk_clip(self, largest_logit: torch.Tensor, clipped_heads: torch.Tensor) -> None:
        """QK-clip's figures of this step (already reduced over ranks)."""
        if self._current is not None:
            self._current.qk_clip = (largest_logit, clipped_heads)

    def newton_schulz(self) -> contextlib.AbstractContextManager[None]:
        """Around one Newton-Schulz call (nothing to time while telemetry is off)."""
        return _UNTIMED if self._current is None else self._timed_newton_schulz(self._current)

    @staticmethod
    @contextlib.contextmanager
    def _timed_newton_schulz(record: _StepRecord) -> Iterator[None]:
        start = record.clock.mark()
        yield
        record.ns_marks.append((start, record.clock.mark()))

    @contextlib.contextmanager
    def updates(self, muon: bool, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """Around the in-place update of Muon blocks (local shards or parts of them) or of
        one AdamW group's local tensors: copies of ``tensors`` before it, their change and
        size added after."""
        delta_at, weight_at, numel_at = (_MUON_DELTA_SQ, _MUON_WEIGHT_SQ, _MUON_NUMEL) if muon else \
            (_ADAMW_DELTA_SQ, _ADAMW_WEIGHT_SQ, _ADAMW_NUMEL)
        if self._current is None:
            yield
            return
        befores = [t.clone() for t in tensors]
        yield
        sums = self._current.sums
        for before, after in list(zip(befores, tensors)):
            if after.is_complex():  # count real and imaginary parts as elements
                before, after = torch.view_as_real(before), torch.view_as_real(after)
            delta = before.sub_(after)  # the copy is ours: reuse it (the sign does not matter)
            # Norms in the tensor's dtype (no upcast copy); the sums across blocks in float64.
            sums[delta_at] += torch.linalg.vector_norm(delta).double().square()
            sums[weight_at] += torch.linalg.vector_norm(after).double().square()
            sums[numel_at] += after.numel()

    def last_step(self) -> StepFigures | None:
        """The last complete step's figures (waits for the reduction that step started)."""
        if self._finished is None:
            return None
        if self._figures is None:
            self._figures = self._finished.figures()
        return self._figures


@dataclass(frozen=True)
class StateBytes:
    """This rank's optimizer state by part (``DMuon.state_bytes()``; local tensors, no
    collective)."""

    muon_bytes: int
    """Muon's state: momentum (with int8's scales) and NorMuon's rows."""
    muon_elements: int
    """The Muon parameters' local elements."""
    adamw_bytes: int
    """AdamW's state: both moments and the step counters."""
    adamw_elements: int

    @property
    def muon_bytes_per_element(self) -> float:
        return self.muon_bytes / self.muon_elements if self.muon_elements else 0.0

    @property
    def adamw_bytes_per_element(self) -> float:
        return self.adamw_bytes / self.adamw_elements if self.adamw_elements else 0.0


def state_bytes(param_groups: Sequence[dict], state: dict) -> StateBytes:
    """:class:`StateBytes` of an optimizer's groups and state, from the local tensors."""
    totals = {True: [0, 0], False: [0, 0]}
    for group in param_groups:
        for param in group["params"]:
            totals[group["use_muon"]][1] += local_of(param).numel()
            totals[group["use_muon"]][0] += sum(local_of(t).nbytes for t in state.get(param, {}).values()
                                                if isinstance(t, torch.Tensor))
    return StateBytes(*totals[True], *totals[False])

