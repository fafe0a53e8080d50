"""torchtitan_ext.titan_log reads TorchTitan's step lines, with and without DMuon's figures."""

from __future__ import annotations

import pytest
from torchtitan.tools.utils import Color, NoColor

from dmuon.step.telemetry import StepFigures
from torchtitan_ext.step_figures import console_text
from torchtitan_ext.titan_log import parse_log

pytestmark = pytest.mark.unit

STOCK_LINE = ("[titan] 2026-11-22 08:20:19,431 - root - INFO - step:  7  loss:  7.86704  grad_norm:  1.2345  "
              "memory:  0.88GiB(3.75%)  tps: 452  tflops: 0.02  mfu: 0.01%")
FIGURES = StepFigures.from_sums(0.1512, 0.0987, 3 * 2**20, [4.0, 100.0, 400.0, 1.0, 25.0, 100.0])


def test_a_stock_step_line_gives_its_loss_and_no_telemetry():
    log = parse_log(STOCK_LINE)
    assert log.train_loss == {7: 7.86704}
    assert log.telemetry == {}


@pytest.mark.parametrize("color", [NoColor(), Color()], ids=["plain", "ansi_colors"])
def test_dmuon_figures_appended_to_a_step_line_are_read_back(color):
    log = parse_log(f"{STOCK_LINE}  {console_text(FIGURES, color)}")
    assert log.train_loss == {7: 7.86704}
    assert log.telemetry[7] == {
        "optimizer_step_ms": 151.2,
        "newton_schulz_ms": 98.7,
        "sent_mib": 3.0,
        "muon_update_rms": 0.1,  # sqrt(4 / 400)
        "muon_weight_rms": 0.5,  # sqrt(100 / 400)
        "adamw_update_rms": 0.1,  # sqrt(1 / 100)
        "adamw_weight_rms": 0.5,  # sqrt(25 / 100)
    }
