"""TorchTitan integration of DMuon, for both TorchTitan lines.

TorchTitan 0.2.x (TOML jobs): name both halves of the extension and the optimizer::

    [job]
    custom_config_module = "torchtitan_ext"           # adds DMuon's [optimizer] fields
    [experimental]
    custom_import = "torchtitan_ext.titan02.job"      # installs DMuon at job start
    [optimizer]
    name = "DMuon"

TorchTitan 0.3.x (Python config functions): build the optimizer config with
``torchtitan_ext.titan03`` (``docs/torchtitan.md`` shows both).

Importing this package changes nothing: no TorchTitan class and no torch function
is touched until a job asks for it. TorchTitan 0.2.x reads ``JobConfig`` from here
while it parses a config that names this module; that read (``__getattr__`` below)
is when the config half installs its parse-time checks.

Layout: the shared core is written once (``routing``, ``step_figures``, ``corpus``,
``tokenizer``, ``integer_histc``, ``launch_checks``, ``titan_log``, ``versions``);
``titan02/`` and ``titan03/`` are the thin adapters, one per TorchTitan line.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JobConfig"]


def __getattr__(name: str) -> Any:
    if name == "JobConfig":
        from .titan02.config import JobConfig
        from .titan02.validation import install_config_validation

        install_config_validation()
        return JobConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
