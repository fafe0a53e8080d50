"""How a CPU TorchTitan process exits (``torchtitan_ext.clean_exit``, which both lines'
CPU layers install; ``tests/test_titan03_clean_exit.py`` checks the 0.3 layer's).

After a successful run the process ends with ``os._exit(0)`` from an ``atexit``
handler, before interpreter finalization, so that gloo's worker threads cannot be
killed mid-destructor (the SIGABRT of pytorch/pytorch#190489). Every other exit is
left to Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchtitan_ext.clean_exit import torchtitan_finished_cleanly

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def main_module(monkeypatch):
    """Replace ``__main__`` by a module whose spec names the given module."""

    def as_main(name: str) -> None:
        fake = types.ModuleType("__main__")
        fake.__spec__ = ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, "__main__", fake)

    monkeypatch.delattr(sys, "last_value", raising=False)
    return as_main


def test_a_torchtitan_main_whose_process_group_is_gone_finished_cleanly(main_module):
    main_module("torchtitan.train")
    assert torchtitan_finished_cleanly()


def test_other_programs_are_never_cut_short(main_module):
    for name in ("pytest", "torchtitan_ext.tokenizer", "my_trainer"):
        main_module(name)
        assert not torchtitan_finished_cleanly(), name


def test_a_run_ended_by_an_exception_did_not_finish_cleanly(main_module, monkeypatch):
    main_module("torchtitan.train")
    monkeypatch.setattr(sys, "last_value", RuntimeError("training failed"), raising=False)
    assert not torchtitan_finished_cleanly()


def test_a_run_whose_process_group_is_still_alive_did_not_finish_cleanly(main_module):
    main_module("torchtitan.train")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not torchtitan_finished_cleanly()
    finally:
        dist.destroy_process_group()


def finish_a_torchtitan_main(tmp_path: Path, install: str) -> tuple[subprocess.CompletedProcess, bool]:
    """Run, in a fresh process, a stand-in for TorchTitan's ``main`` that ``install``s a CPU
    layer, trains (one gloo ``all_reduce``) and destroys its group; return the process and
    whether interpreter finalization was reached."""
    # A handler registered before torchtitan_ext's runs after it (atexit is LIFO):
    # if it never writes its marker, the process ended inside torchtitan_ext's handler.
    marker = tmp_path / "finalization_reached"
    script = textwrap.dedent(f"""
        import atexit, sys
        from importlib.machinery import ModuleSpec
        atexit.register(lambda: open({str(marker)!r}, "w").close())
        sys.modules["__main__"].__spec__ = ModuleSpec("torchtitan.train", None)
        import torch, torch.distributed as dist
        {install}
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dist.all_reduce(torch.ones(4))
        dist.destroy_process_group()
        print("training done", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, marker.exists()


def test_a_cleanly_finished_torchtitan_process_exits_0_before_interpreter_finalization(tmp_path):
    proc, finalized = finish_a_torchtitan_main(tmp_path, "import torchtitan_ext.clean_exit as c; c.install()")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training done" in proc.stdout
    assert not finalized


def test_the_0_2_cpu_layer_installs_the_clean_exit(tmp_path):
    from torchtitan_ext.versions import torchtitan_line

    if torchtitan_line() != "0.2":
        pytest.skip("needs TorchTitan 0.2.x")
    proc, finalized = finish_a_torchtitan_main(tmp_path, "import torchtitan_ext.titan02.job")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.accelerator.is_available() or not finalized
