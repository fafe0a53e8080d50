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

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torchtitan.components.metrics import MetricsProcessor

from ..step_figures import console_text, figures_of, metric_values


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


class DMuonMetricsProcessor(MetricsProcessor):
    """TorchTitan's ``MetricsProcessor`` that adds DMuon's figures to each logged step.

    When the processor's optimizers are a DMuon container with telemetry on, ``log``
    adds the figures to ``extra_metrics`` (which TorchTitan hands to its metric
    loggers) and appends their text to the one step line TorchTitan prints.
    Otherwise it is TorchTitan's ``log`` unchanged.
    """

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        figures = figures_of(self.optimizers)
        if figures is None:
            return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        extra = {**(extra_metrics or {}), **metric_values(figures)}
        with _appended_to_step_line(console_text(figures, self.color)):
            return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)


def build_dmuon_metrics_processor(job_config: Any, parallel_dims: Any, model_args: Any = None,
                                  tag: str | None = None) -> DMuonMetricsProcessor:
    """A ``TrainSpec.build_metrics_processor_fn``: TorchTitan's default builder's
    processor, with DMuon's figures."""
    return DMuonMetricsProcessor(job_config, parallel_dims, tag)
