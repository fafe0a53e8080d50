"""``[experimental] custom_import`` of the 0.2.x switch runs (``tests/test_torchtitan_switches.py``):
the extension's job half, as the TOML's custom_import installs it, plus

- llama3 flavor ``debugmodel_deep``: the debug model with ``DEEP_LAYERS`` blocks, more
  than Dynamo's recompile limit (8), the depth at which a recompile per block is fatal
  under TorchTitan's ``fullgraph=True``;
- with ``DMUON_SWITCH_PROBE=<folder>`` set, the step probe of ``tests/titan_hooks/step_probe.py``.
  The variable has no ``TORCHTITAN_EXT_`` prefix, so ``tests/titan_runs.py`` leaves this
  module as the run's custom_import.
"""

from __future__ import annotations

import dataclasses

import torchtitan_ext.titan02.job  # noqa: F401  (installs the extension, as the TOML's custom_import does)
from tests.titan_hooks.step_probe import install_from_env

DEEP_FLAVOR = "debugmodel_deep"
DEEP_LAYERS = 12


def register_deep_flavor() -> None:
    """``debugmodel_deep``: llama3's ``debugmodel`` with ``DEEP_LAYERS`` blocks (the train
    spec reads the same ``llama3_args`` dict)."""
    from torchtitan.models.llama3 import llama3_args

    llama3_args.setdefault(DEEP_FLAVOR, dataclasses.replace(llama3_args["debugmodel"], n_layers=DEEP_LAYERS))


register_deep_flavor()
install_from_env()
