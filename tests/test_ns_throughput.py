"""benchmarks.ns_throughput's algorithm comparison runs and reports what it promises
(not speed: the figures are the lead's to measure on a quiet machine)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.ns_throughput import main, measure
from dmuon.numerics.newton_schulz import newton_schulz_flops

pytestmark = pytest.mark.unit


def test_comparing_algorithms_reports_each_ones_time_and_its_flops_ratio_over_the_first():
    result = measure(torch.device("cpu"), [(8, 32)], repeats=1, peak_size=16, ns_dtype="float32",
                     algorithms=("standard", "gram"), dmuon_step=True)
    (row,) = result["rows"]
    assert {"standard_ms", "gram_ms", "gram_speedup", "standard_step_ms", "gram_step_speedup"} <= set(row)
    assert row["gram_flops_ratio"] == round(newton_schulz_flops((8, 32)) / newton_schulz_flops((8, 32), 5, "gram"), 3)
    assert result["ns_dtype"] == "float32"


def test_the_comparison_names_the_cpu_capability(capsys):
    main(["--device", "cpu", "--threads", "1", "--ns-dtype", "float32", "--algorithms", "standard", "auto",
          "--shapes", "8x32", "--repeats", "1", "--peak-matmul", "16"])
    out = capsys.readouterr().out
    assert torch.backends.cpu.get_cpu_capability() in out
    assert "auto speedup" in out
