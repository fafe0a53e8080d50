"""Importing the extension changes nothing until a job asks for it, and the patches it
keeps (where TorchTitan has no hook) refuse TorchTitan releases they were not checked on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchtitan_ext import versions

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

# Every module of the extension but the two whose import *is* the job asking for it.
# (titan02.job is 0.2.x's [experimental] custom_import; the other line's adapter cannot
# import beside this line's TorchTitan.)
_IMPORT_EVERYTHING = textwrap.dedent("""
    import importlib, pkgutil, sys
    import torch
    import torchtitan_ext
    from torchtitan_ext.versions import torchtitan_line

    def watched():
        import torchtitan.tools.utils as tt_utils
        import torchtitan.components.checkpoint as tt_checkpoint
        import torchtitan.components.metrics as tt_metrics
        from torchtitan.config.manager import ConfigManager
        return {
            "torch.histc": torch.histc,
            "device_type": tt_utils.device_type,
            "ConfigManager._validate_config": ConfigManager._validate_config,
            "CheckpointManager.dcp_load": getattr(tt_checkpoint.CheckpointManager, "dcp_load", None),
            "MetricsProcessor.log": tt_metrics.MetricsProcessor.log,
            "build_device_memory_monitor": tt_metrics.build_device_memory_monitor,
        }

    before = watched()
    other_line = "titan03" if torchtitan_line() == "0.2" else "titan02"
    skipped = {"torchtitan_ext.titan02.job"}
    imported = []
    for info in pkgutil.walk_packages(torchtitan_ext.__path__, "torchtitan_ext."):
        if info.name in skipped or info.name.startswith(f"torchtitan_ext.{other_line}"):
            continue
        importlib.import_module(info.name)
        imported.append(info.name)
    after = watched()
    changed = [name for name in before if before[name] is not after[name] and before[name] != after[name]]
    print("IMPORTED", len(imported), "CHANGED", changed)
""")


def _run(script: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_importing_every_module_of_the_extension_leaves_torch_and_torchtitan_untouched():
    proc = _run(_IMPORT_EVERYTHING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHANGED []" in proc.stdout, proc.stdout
    assert "IMPORTED 0 " not in proc.stdout


@pytest.mark.skipif(versions.torchtitan_line() != "0.2", reason="the 0.2.x job module needs TorchTitan 0.2.x")
def test_the_0_2_job_module_is_what_installs_the_cpu_layer_and_the_dmuon_specs():
    proc = _run(textwrap.dedent("""
        import torch
        histc = torch.histc
        import torchtitan_ext.titan02.job
        from torchtitan.protocols.train_spec import get_train_spec
        from torchtitan_ext.titan02.metrics import build_dmuon_metrics_processor
        spec = get_train_spec("llama3")
        print("HISTC", torch.histc is histc, "METRICS", spec.build_metrics_processor_fn is build_dmuon_metrics_processor)
    """))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cpu_only = "HISTC False" if not _has_accelerator() else "HISTC True"
    assert f"{cpu_only} METRICS True" in proc.stdout


def _has_accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()


def test_a_patch_refuses_a_torchtitan_release_it_was_not_checked_on(monkeypatch):
    monkeypatch.setattr(versions, "torchtitan_version", lambda: "0.2.9")
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"checked on TorchTitan 0\.2\.2 .* has 0\.2\.9.*TORCHTITAN_EXT_ALLOW_UNTESTED=1"):
        versions.require_tested("0.2", "SomeClass.method")


def test_the_untested_release_error_can_be_waived_by_the_environment(monkeypatch):
    monkeypatch.setattr(versions, "torchtitan_version", lambda: "0.2.9")
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    versions.require_tested("0.2", "SomeClass.method")


def test_the_line_is_read_from_the_installed_release(monkeypatch):
    monkeypatch.setattr(versions, "torchtitan_version", lambda: "0.3.0")
    assert versions.torchtitan_line() == "0.3"
    monkeypatch.setattr(versions, "torchtitan_version", lambda: "")
    assert versions.torchtitan_line() == ""
