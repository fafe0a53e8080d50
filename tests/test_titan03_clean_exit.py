"""The TorchTitan 0.3 CPU layer ends a finished job before interpreter finalization
(``torchtitan_ext.clean_exit``; why: ``tests/test_torchtitan_process_exit.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.titan03_support import require_titan03

require_titan03()

from tests.test_torchtitan_process_exit import finish_a_torchtitan_main  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_0_3_cpu_layer_installs_the_clean_exit(tmp_path):
    proc, finalized = finish_a_torchtitan_main(
        tmp_path, "from torchtitan_ext.titan03 import cpu_compat; cpu_compat.install()")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.accelerator.is_available() or not finalized
