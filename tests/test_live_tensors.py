"""Memory measured from live tensors (``benchmarks.live_tensors``) and the benchmark that
reports the momentum's with it (``benchmarks.momentum_memory``, docs/optimizer.md's
"Memory on real ranks"): a small run, its figures checked, not its size."""

from __future__ import annotations

import pytest
import torch

from benchmarks import momentum_memory
from benchmarks.live_tensors import PeakBytes, live_storages


@pytest.mark.unit
def test_the_peak_counts_each_new_storage_until_it_is_freed_and_no_view():
    x = torch.zeros(1000)
    with PeakBytes() as peak:
        y = x * 2  # 4,000 bytes
        z = y.view(10, 100)  # a view: nothing new
        x.add_(1)  # in place: nothing new
        w = y + 1  # 8,000 alive
        del y, z
        v = w * 3  # 8,000 again: y's storage was freed
    assert peak.bytes == 8000
    assert v.shape == w.shape


@pytest.mark.unit
def test_live_storages_find_a_tensor_once_by_its_storage():
    x = torch.zeros(256)
    views = [x[:10], x.view(16, 16)]
    found = live_storages()
    assert found[x.untyped_storage().data_ptr()][0] == 1024
    assert sum(1 for t in views if t.untyped_storage().data_ptr() in found) == 2


@pytest.mark.multirank
def test_the_momentum_memory_benchmark_reports_each_form_at_rest_and_at_the_peak(capsys):
    momentum_memory.main(["--dim", "128", "--layers", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:]}
    states = {name: row[1] for name, row in rows.items()}
    assert states == {"None": 4.0, "bfloat16": 2.0, "int8": 1.031}
    # At rest: the state, and the step's pending status sums (a few bytes a parameter).
    assert all(0 <= row[0] - row[1] < 0.01 and row[2] > 0 for row in rows.values())


@pytest.mark.multirank
def test_the_whole_optimizer_memory_reports_each_parts_state_per_parameter(capsys):
    # dim 128: Muon's rows and the embedding's are whole int8 blocks; the norms' moments stay fp32
    momentum_memory.main(["--dim", "128", "--layers", "1", "--vocab", "256", "--world-size", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split()[:2]): [float(v) for v in line.split()[2:]] for line in lines[2:]}
    muon = {forms: row[0] for forms, row in rows.items()}
    assert muon == {("None", "None"): 4.0, ("int8", "None"): 1.031, ("int8", "bfloat16"): 1.031,
                    ("int8", "int8"): 1.031, ("bfloat16", "bfloat16"): 2.0}
    adamw = {forms: row[1] for forms, row in rows.items()}
    # the norms' fp32 moments and the step counters: at or a little above 8, 4 and 2.0625
    assert 8.0 <= adamw[("int8", "None")] < 8.01
    assert 4.0 <= adamw[("int8", "bfloat16")] < 4.05 and 2.0625 <= adamw[("int8", "int8")] < 2.12
    for muon_state, adamw_state, whole, peak in rows.values():  # the whole: the parts by their shares
        assert min(muon_state, adamw_state) <= whole <= max(muon_state, adamw_state) and peak > 0
