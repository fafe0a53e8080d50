"""The job half of the TorchTitan 0.2.x integration: importing this module installs it.

Name it in the TOML, next to the config half::

    [job]
    custom_config_module = "torchtitan_ext"              # the [optimizer] fields
    [experimental]
    custom_import = "torchtitan_ext.titan02.job"         # this module

TorchTitan imports ``[experimental] custom_import`` at the start of the Trainer,
before it picks a device, builds the model or reads a checkpoint. That import is
the job asking for DMuon, so this is the one module of the extension whose import
changes anything; it:

1. installs the CPU/gloo layer, only when there is no accelerator (``cpu_compat``);
2. registers the embedded ``pydoc`` / ``pydoc_validation`` datasets (``torchtitan_ext.datasets``);
3. re-registers TorchTitan's built-in model specs so that ``name = "DMuon"`` builds
   a ``DMuonOptimizersContainer`` and the step line carries DMuon's figures, while
   ``Adam``/``AdamW`` stay stock (``train_specs``, ``container``, ``metrics``);
4. checks, before a checkpoint is loaded, that no parameter moved between Muon and
   AdamW since it was saved (``routing_check``);
5. warns when ``torchrun`` may restart the job in a way that can fail to reconnect
   (``torchtitan_ext.launch_checks``).

Before any of that, it refuses a ``name = "DMuon"`` job whose config was parsed without
``[job] custom_config_module`` (``validation.check_config_module_named``): its own import
is the first moment the extension runs in such a job, before any device, process group
or model exists.
"""

from __future__ import annotations

import sys
from typing import Any

from ..datasets import register_datasets
from ..launch_checks import warn_about_risky_restarts
from . import cpu_compat, routing_check
from .train_specs import register_builtin_specs
from .validation import check_config_module_named

# TorchTitan 0.2.x's Trainer.__init__(self, job_config) imports custom_import first thing.
_IMPORTER = "__init__"
_CONFIG_ARGUMENT = "job_config"


def importing_job_config() -> Any:
    """The config of the Trainer whose ``__init__`` is importing this module, or ``None``
    (imported some other way, e.g. from a test or a user's own module)."""
    frame = sys._getframe(1)
    while frame is not None:
        config = frame.f_locals.get(_CONFIG_ARGUMENT)
        if frame.f_code.co_name == _IMPORTER and hasattr(config, "optimizer") and hasattr(config, "job"):
            return config
        frame = frame.f_back
    return None


if (_config := importing_job_config()) is not None:
    check_config_module_named(_config)
cpu_compat.apply()
register_datasets()
register_builtin_specs()
routing_check.install()
warn_about_risky_restarts()
