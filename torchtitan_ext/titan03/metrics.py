"""DMuon's step figures in TorchTitan 0.3.x's metrics: the step line, TensorBoard, W&B.

Name ``DMuonMetricsProcessor.Config`` as the job's ``metrics`` (the config functions in
``configs.py`` do) and set ``telemetry=True`` in DMuon's factory options: each logged
step line then ends with DMuon's times, bytes and update RMS, and the metric loggers
get the ``step_figures.METRICS`` keys. With telemetry off it is TorchTitan's processor.
A config is TorchTitan 0.3's own extension point, so nothing is patched.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.metrics import MetricsProcessor

from ..step_figures import StepFiguresLog


class DMuonMetricsProcessor(StepFiguresLog, MetricsProcessor):
    """TorchTitan 0.3.x's ``MetricsProcessor`` with DMuon's figures (``StepFiguresLog``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        """TorchTitan's metrics settings, unchanged; building it builds this processor."""
