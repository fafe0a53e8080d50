"""DMuon's step figures as TorchTitan metrics: the keys, the step-line text and the
``log`` that adds them, written once for both TorchTitan lines (each line's adapter
mixes ``StepFiguresLog`` into its own ``MetricsProcessor``; both lines' ``log`` take
the same arguments and hold the container in ``self.optimizers``).

``titan_log.parse_log`` reads the step-line text back; keep the two in step.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

from dmuon import StepFigures

# TensorBoard / W&B keys, in TorchTitan's "group/name(unit)" style.
METRICS = {
    "dmuon/optimizer_step(s)": lambda f: f.step_s,
    "dmuon/newton_schulz(s)": lambda f: f.newton_schulz_s,
    "dmuon/bytes_sent(MiB)": lambda f: f.bytes_sent / 2**20,
    "dmuon/muon_update_rms": lambda f: f.muon_update_rms,
    "dmuon/muon_weight_rms": lambda f: f.muon_weight_rms,
    "dmuon/adamw_update_rms": lambda f: f.adamw_update_rms,
    "dmuon/adamw_weight_rms": lambda f: f.adamw_weight_rms,
}


# With QK-clip (or [optimizer] track_max_logits): the largest attention logit of the step
# over every rank and model part, and how many heads were clipped. Left out without it
# (max_logit is NaN then), so runs without QK-clip log exactly what they logged before.
QK_CLIP_METRICS = {
    "dmuon/max_logit": lambda f: f.max_logit,
    "dmuon/qk_clipped_heads": lambda f: f.qk_clipped_heads,
}


def _qk_clip_active(figures: StepFigures) -> bool:
    return not math.isnan(figures.max_logit)


def metric_values(figures: StepFigures) -> dict[str, float]:
    metrics = {**METRICS, **QK_CLIP_METRICS} if _qk_clip_active(figures) else METRICS
    values = {key: value(figures) for key, value in metrics.items()}
    if figures.skipped_steps:  # skip_nonfinite skipped a step: from then on, how many
        values["dmuon/skipped_steps"] = figures.skipped_steps
    return values


def console_text(figures: StepFigures, color: Any) -> str:
    """What the step line gets appended (``titan_log.parse_log`` reads it back)."""
    f = figures
    return (
        f"{color.white}opt: {f.step_s * 1e3:.1f}ms  ns: {f.newton_schulz_s * 1e3:.1f}ms  "
        f"sent: {f.bytes_sent / 2**20:.2f}MiB  "
        f"muon_rms upd/w: {f.muon_update_rms:.2e}/{f.muon_weight_rms:.2e}  "
        f"adamw_rms upd/w: {f.adamw_update_rms:.2e}/{f.adamw_weight_rms:.2e}"
        + (f"  max_logit: {f.max_logit:.2f}  clipped_heads: {f.qk_clipped_heads}" if _qk_clip_active(f) else "")
        + (f"  skipped: {f.skipped_steps}" if f.skipped_steps else "")
        + color.reset
    )


def combined_figures(parts: list[StepFigures | None]) -> StepFigures | None:
    """One rank's figures over its DMuon optimizers (one per model part), or ``None``
    when there is none, or one has no figures (telemetry off, no step yet)."""
    if not parts or any(part is None for part in parts):
        return None
    return parts[0] if len(parts) == 1 else StepFigures.combine(parts)


def figures_of(optimizers: Any) -> StepFigures | None:
    """The last step's figures of a DMuon container with telemetry on, else ``None``."""
    read = getattr(optimizers, "telemetry", None)
    return read() if callable(read) else None


def captured_skips_of(optimizers: Any) -> int | None:
    """A container with captured steps: what their replays found, read now (its first error
    raised here; ``captured_steps.CapturedSteps.check_captured_steps``), as the skipped
    steps so far; else ``None``."""
    check = getattr(optimizers, "check_captured_steps", None)
    return check() if callable(check) else None


@contextlib.contextmanager
def _appended_to_step_line(text: str) -> Iterator[None]:
    """Append ``text`` to the step line logged inside the block.

    TorchTitan's ``logger`` is the root logger and ``MetricsProcessor.log`` logs exactly
    one info line, the step line; a filter on that logger edits the record before any
    handler formats it.
    """
    root = logging.getLogger()

    def append(record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "step:" in record.msg and "loss:" in record.msg:
            record.msg = f"{record.msg}  {text}"
        return True

    root.addFilter(append)
    try:
        yield
    finally:
        root.removeFilter(append)


class StepFiguresLog:
    """Mixin for a TorchTitan ``MetricsProcessor``: adds DMuon's figures to each logged step.

    When the processor's optimizers are a DMuon container with telemetry on, ``log``
    adds the figures to ``extra_metrics`` (which TorchTitan hands to its metric
    loggers) and appends their text to the one step line TorchTitan prints. With captured
    steps (telemetry is off then) it reads what their replays found: an error is raised,
    skipped steps are logged as ``skipped: N``. Otherwise it is TorchTitan's ``log`` unchanged.
    """

    optimizers: Any
    color: Any

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        figures = figures_of(self.optimizers)
        skipped = captured_skips_of(self.optimizers)
        if figures is None and not skipped:
            return super().log(step, global_avg_loss, global_max_loss, grad_norm,  # type: ignore[misc]
                               extra_metrics=extra_metrics)
        if figures is None:  # captured steps: no figures, the skipped steps only
            extra = {**(extra_metrics or {}), "dmuon/skipped_steps": skipped}
            text = f"{self.color.white}skipped: {skipped}{self.color.reset}"
        else:
            extra = {**(extra_metrics or {}), **metric_values(figures)}
            text = console_text(figures, self.color)
        with _appended_to_step_line(text):
            return super().log(step, global_avg_loss, global_max_loss, grad_norm,  # type: ignore[misc]
                               extra_metrics=extra)
