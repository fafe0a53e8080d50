"""``[experimental] custom_import`` for test runs: the extension's job half plus the
test hooks armed by environment variables (``fault_injection``, ``state_dump``,
``grad_fault``)."""

import torchtitan_ext.titan02.job  # noqa: F401  (installs the extension, as the TOML's custom_import does)

from tests.titan_hooks import fault_injection, grad_fault, state_dump

fault_injection.install_from_env()
state_dump.install_from_env()
grad_fault.install_from_env()
