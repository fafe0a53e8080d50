"""DMuon's step figures in TorchTitan's own metrics: the console step line, TensorBoard, W&B.

With ``[optimizer] telemetry = true`` (and ``name = "DMuon"``), every logged step gets

* on the console, appended to TorchTitan's step line (this rank's times and bytes,
  RMS over all ranks; the figures are those of the logged step, not averages)::

      step: 10  loss:  6.92  grad_norm: ...  mfu: 0.01%  opt: 151.2ms  ns: 98.7ms  sent: 0.30MiB
      muon_rms upd/w: 1.05e-03/2.71e-02  adamw_rms upd/w: 2.02e-03/4.10e-01

  (one line in the log, wrapped here);
* in TensorBoard / W&B, when enabled, the ``step_figures.METRICS`` keys, next to TorchTitan's
  ``time_metrics/...`` and ``memory/...`` keys.

How: through ``TrainSpec.build_metrics_processor_fn``, TorchTitan's hook for its metrics
processor. ``train_specs.with_dmuon`` sets it to ``build_dmuon_metrics_processor`` on
every spec that has no builder of its own; with telemetry off the step lines are
exactly TorchTitan's.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.metrics import MetricsProcessor

from ..step_figures import StepFiguresLog


class DMuonMetricsProcessor(StepFiguresLog, MetricsProcessor):
    """TorchTitan 0.2.x's ``MetricsProcessor`` with DMuon's figures (``StepFiguresLog``)."""


def build_dmuon_metrics_processor(job_config: Any, parallel_dims: Any, model_args: Any = None,
                                  tag: str | None = None) -> DMuonMetricsProcessor:
    """A ``TrainSpec.build_metrics_processor_fn``: TorchTitan's default builder's
    processor, with DMuon's figures."""
    return DMuonMetricsProcessor(job_config, parallel_dims, tag)
