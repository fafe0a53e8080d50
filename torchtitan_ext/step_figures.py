"""DMuon's step figures as TorchTitan metrics: the keys and the step-line text, written
once for both TorchTitan lines (each line's adapter decides where they go).

``titan_log.parse_log`` reads the step-line text back; keep the two in step.
"""

from __future__ import annotations

from typing import Any

from dmuon.telemetry import StepFigures

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


def metric_values(figures: StepFigures) -> dict[str, float]:
    return {key: value(figures) for key, value in METRICS.items()}


def console_text(figures: StepFigures, color: Any) -> str:
    """What the step line gets appended (``titan_log.parse_log`` reads it back)."""
    f = figures
    return (
        f"{color.white}opt: {f.step_s * 1e3:.1f}ms  ns: {f.newton_schulz_s * 1e3:.1f}ms  "
        f"sent: {f.bytes_sent / 2**20:.2f}MiB  "
        f"muon_rms upd/w: {f.muon_update_rms:.2e}/{f.muon_weight_rms:.2e}  "
        f"adamw_rms upd/w: {f.adamw_update_rms:.2e}/{f.adamw_weight_rms:.2e}{color.reset}"
    )


def figures_of(optimizers: Any) -> StepFigures | None:
    """The last step's figures of a DMuon container with telemetry on, else ``None``."""
    read = getattr(optimizers, "telemetry", None)
    return read() if callable(read) else None
