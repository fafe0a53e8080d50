"""Test-only hooks for TorchTitan 0.2.x runs, kept out of the shipped package.

A test that needs one launches TorchTitan with
``--experimental.custom_import tests.titan_hooks.job`` (``tests/titan_runs.py`` does
it whenever the run's environment sets a ``TORCHTITAN_EXT_*`` hook variable): that
module installs the extension's job half as the TOML would, then arms the hooks the
environment asks for.
"""
