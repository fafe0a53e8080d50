"""TorchTitan 0.3.x (Python config functions): the adapter over the shared core.

* ``optimizer``: ``DMuonOptimizersContainer`` (TorchTitan's container that also
  builds ``optimizer_name="DMuon"`` groups), its checked ``Config`` and
  ``dmuon_optimizer(lr=..., **options)``, the DMuon twin of ``default_adamw``.

Importing this package, or any module in it, changes nothing in TorchTitan or
torch: no patch, no registration. The names below are loaded on first use, so
that importing the package works beside TorchTitan 0.2.x too.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module of this package that defines it.
_EXPORTS = {
    "DMuonOptimizersContainer": "optimizer",
    "dmuon_optimizer": "optimizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
