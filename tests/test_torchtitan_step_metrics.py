"""torchtitan_ext.titan02.metrics: DMuon's figures join TorchTitan's step metrics when telemetry is on.

These tests call ``DMuonMetricsProcessor.log`` in-process on a processor whose collaborators are stand-ins; tests/test_torchtitan_e2e.py checks the
console lines of real runs.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from torchtitan.components.metrics import DeviceMemStats, MetricsProcessor
from torchtitan.tools.utils import NoColor

from dmuon.step.telemetry import StepFigures
from torchtitan_ext.step_figures import METRICS
from torchtitan_ext.titan02.metrics import DMuonMetricsProcessor

pytestmark = pytest.mark.unit

FIGURES = StepFigures.from_sums(0.15, 0.1, 2**20, [4.0, 100.0, 400.0, 1.0, 25.0, 100.0])


class RecordingLogger:
    """Stands in for TorchTitan's TensorBoard / W&B logger container."""

    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((dict(metrics), step))


def _processor(optimizers) -> MetricsProcessor:
    processor = DMuonMetricsProcessor.__new__(DMuonMetricsProcessor)  # no device, no loggers to build
    memory = DeviceMemStats(0.5, 1.0, 0.5, 1.0, 0, 0)
    processor.logger = RecordingLogger()
    processor.parallel_dims = SimpleNamespace(non_data_parallel_size=1)
    processor.job_config = SimpleNamespace(metrics=SimpleNamespace(log_freq=1))
    processor.device_memory_monitor = SimpleNamespace(get_peak_stats=lambda: memory, reset_peak_stats=lambda: None)
    processor.color = NoColor()
    processor.gpu_peak_flops = 1e12
    processor.num_flops_per_token = 1
    processor.ntokens_since_last_log = 100
    processor.data_loading_times = [0.01]
    processor.time_last_log = 0.0
    processor.optimizers = optimizers
    return processor


def _log_step(processor: MetricsProcessor, caplog) -> str:
    with caplog.at_level(logging.INFO):
        processor.log(3, 2.5, 2.6, 0.9, extra_metrics={"lr": 0.01})
    (line,) = [r.getMessage() for r in caplog.records if "step:" in r.getMessage()]
    return line


def test_with_telemetry_the_metric_loggers_get_every_dmuon_figure(caplog):
    processor = _processor(SimpleNamespace(telemetry=lambda: FIGURES))
    _log_step(processor, caplog)
    ((metrics, step),) = processor.logger.logged
    assert step == 3 and metrics["lr"] == 0.01
    assert {key: metrics[key] for key in METRICS} == {
        "dmuon/optimizer_step(s)": 0.15,
        "dmuon/newton_schulz(s)": 0.1,
        "dmuon/bytes_sent(MiB)": 1.0,
        "dmuon/muon_update_rms": pytest.approx(0.1),
        "dmuon/muon_weight_rms": pytest.approx(0.5),
        "dmuon/adamw_update_rms": pytest.approx(0.1),
        "dmuon/adamw_weight_rms": pytest.approx(0.5),
    }


def test_with_telemetry_the_step_line_ends_with_the_dmuon_figures(caplog):
    line = _log_step(_processor(SimpleNamespace(telemetry=lambda: FIGURES)), caplog)
    assert line.startswith("step:  3  loss:  2.50000")
    assert line.endswith("mfu: 0.00%  opt: 150.0ms  ns: 100.0ms  sent: 1.00MiB  "
                         "muon_rms upd/w: 1.00e-01/5.00e-01  adamw_rms upd/w: 1.00e-01/5.00e-01")


@pytest.mark.parametrize("optimizers", [SimpleNamespace(telemetry=lambda: None), SimpleNamespace()],
                         ids=["dmuon_telemetry_off", "not_dmuon"])
def test_without_telemetry_the_step_line_and_metrics_are_torchtitans(optimizers, caplog):
    processor = _processor(optimizers)
    line = _log_step(processor, caplog)
    assert line.endswith("mfu: 0.00%")
    ((metrics, _),) = processor.logger.logged
    assert metrics["lr"] == 0.01  # TorchTitan's own metrics still arrive
    assert not any(key.startswith("dmuon/") for key in metrics)


def _captured(check):
    """A container with captured steps (telemetry is off under them): ``check`` stands in for
    ``CapturedSteps.check_captured_steps``."""
    return SimpleNamespace(telemetry=lambda: None, check_captured_steps=check)


def test_with_captured_steps_a_skipped_step_ends_the_step_line_and_reaches_the_metrics(caplog):
    processor = _processor(_captured(lambda: 2))
    line = _log_step(processor, caplog)
    assert line.endswith("mfu: 0.00%  skipped: 2")
    ((metrics, _),) = processor.logger.logged
    assert metrics["dmuon/skipped_steps"] == 2


def test_with_captured_steps_and_no_skip_the_step_line_is_torchtitans(caplog):
    assert _log_step(_processor(_captured(lambda: 0)), caplog).endswith("mfu: 0.00%")


def test_with_captured_steps_an_error_their_replays_found_is_raised_at_the_logging_step(caplog):
    def check() -> int:
        raise ValueError("DMuon: 1 rank(s) found an invalid gradient or shard in the previous step")

    with pytest.raises(ValueError, match="invalid gradient"):
        _log_step(_processor(_captured(check)), caplog)


def test_the_container_checks_every_captured_step_and_counts_its_dmuons_skips():
    import torch

    from dmuon import DMuon
    from torchtitan_ext.captured_steps import CapturedSteps

    checked = []
    container = CapturedSteps()
    container.optimizers = [DMuon([("w", torch.nn.Parameter(torch.ones(4, 4)))]), torch.optim.SGD([torch.ones(1)])]
    assert container.check_captured_steps() is None  # not captured
    container.captured_steps = [SimpleNamespace(check=lambda: checked.append(1)), None]
    assert container.check_captured_steps() == 0 and checked == [1]


def test_a_captured_step_both_model_parts_skipped_counts_once(monkeypatch):
    # Pipeline stages are DMuons of their own on the same ranks: a step each of them skipped
    # is one skipped step, as the step's figures count it (StepFigures.combine: the largest).
    import torch

    from dmuon import DMuon
    from torchtitan_ext.captured_steps import CapturedSteps

    container = CapturedSteps()
    parts = [DMuon([(f"w{i}", torch.nn.Parameter(torch.ones(4, 4)))]) for i in range(2)]
    container.optimizers = parts
    container.captured_steps = [SimpleNamespace(check=lambda: None)] * 2
    monkeypatch.setattr(DMuon, "skipped_steps", property(lambda self: 1))
    assert container.check_captured_steps() == 1
