"""Which TorchTitan releases each line's patches were checked on, and the check itself.

The extension prefers TorchTitan's own hooks (0.2.x: ``[job] custom_config_module``,
``[experimental] custom_import``, ``TrainSpec`` builders; 0.3.x: config functions and
``OptimizersContainer`` subclasses). Where no hook exists it patches one TorchTitan
function, and such a patch is only safe on a release whose code it was read against:
every patch calls :func:`require_tested` before it installs itself.
"""

from __future__ import annotations

import importlib.metadata
import os

# A patch was checked on exactly these releases (tests run on the first of each).
TESTED_RELEASES = {
    "0.2": ("0.2.2",),
    "0.3": ("0.3.0",),
}
ALLOW_UNTESTED_ENV = "TORCHTITAN_EXT_ALLOW_UNTESTED"


def torchtitan_version() -> str:
    """The installed TorchTitan release, e.g. ``"0.2.2"`` (``""`` when none is installed)."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return ""


def torchtitan_line() -> str:
    """``"0.2"`` or ``"0.3"``: the line the installed release belongs to (``""`` if neither)."""
    version = torchtitan_version()
    return next((line for line in TESTED_RELEASES if version.startswith(line + ".")), "")


def require_tested(line: str, what: str) -> None:
    """Raise ``RuntimeError`` unless the installed TorchTitan is a release ``what`` was checked on.

    ``what`` names the patched function, for the message. Setting the environment
    variable ``TORCHTITAN_EXT_ALLOW_UNTESTED=1`` turns the error into a pass, for a
    user who wants to try an untested release at their own risk.
    """
    version = torchtitan_version()
    tested = TESTED_RELEASES[line]
    if version in tested or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise RuntimeError(
        f"torchtitan_ext patches {what}, which has no extension hook in TorchTitan {line}.x; "
        f"the patch was checked on TorchTitan {', '.join(tested)} and this environment has "
        f"{version or 'no TorchTitan'}. Install TorchTitan {tested[0]}, or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try this release anyway."
    )
