"""docs/architecture.md names every module and every folder of dmuon, so a newcomer finds
the file of any piece of the step there, and a module added or moved cannot be left out.

The rule: a module is named when its path from the repository root (``dmuon/step/phases.py``)
or its dotted name (``dmuon.step.phases``, also as the start of a longer dotted name such as
``dmuon.step.phases.StepPhases``) appears in the page as a whole name: not as the start of a
longer path or identifier (``dmuon/step/phases_old.py`` does not name ``dmuon/step/phases.py``).
A folder is named by its path with a trailing slash (``dmuon/step/``). The modules are every
``.py`` file under dmuon/ but the ``__init__.py`` files and the files inside
dmuon/tools/dry_run/, which the page covers by naming that folder; they are listed from the
file system when the test runs, so a new module fails it until the page names it.

That every module and path the page names exists is tests/test_docs_module_paths.py's check
(for every page of the docs), not repeated here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "dmuon"
COVERED_BY_FOLDER = PACKAGE / "tools" / "dry_run"  # named as a folder, its files not one by one


def dmuon_modules() -> list[str]:
    """Every module of dmuon as its path from the repository root, e.g. ``dmuon/step/phases.py``."""
    return sorted(str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
                  if path.name != "__init__.py" and COVERED_BY_FOLDER not in path.parents)


def dmuon_folders() -> list[str]:
    """Every package folder under dmuon/ (not dmuon/ itself), e.g. ``dmuon/step/``."""
    return sorted(f"{path.parent.relative_to(REPO)}/" for path in PACKAGE.rglob("__init__.py")
                  if path.parent != PACKAGE)


def names_module(text: str, module: str) -> bool:
    """Whether ``text`` names ``module`` (``dmuon/x/y.py``) by its path or its dotted name."""
    path = re.escape(module)
    dotted = re.escape(module.removesuffix(".py").replace("/", "."))
    return re.search(rf"(?<![\w./-]){path}(?![\w/-])|(?<![\w./-]){dotted}(?![\w/-])", text) is not None


def names_folder(text: str, folder: str) -> bool:
    """Whether ``text`` names ``folder`` (``dmuon/x/``) as a folder, not only as the start of a file's path."""
    return re.search(rf"(?<![\w./-]){re.escape(folder)}(?![\w.-])", text) is not None


def unnamed_modules(text: str, modules: Iterable[str]) -> list[str]:
    """The ``modules`` that ``text`` does not name, in order."""
    return [module for module in modules if not names_module(text, module)]


def unnamed_folders(text: str, folders: Iterable[str]) -> list[str]:
    """The ``folders`` that ``text`` does not name, in order."""
    return [folder for folder in folders if not names_folder(text, folder)]


def test_the_architecture_page_names_every_module_of_dmuon():
    modules = dmuon_modules()
    assert "dmuon/step/phases.py" in modules and "dmuon/optimizer.py" in modules
    missing = unnamed_modules(PAGE.read_text(), modules)
    assert not missing, f"docs/architecture.md does not name these modules: {missing}"


def test_the_architecture_page_names_every_folder_of_dmuon():
    folders = dmuon_folders()
    assert "dmuon/step/" in folders and "dmuon/tools/dry_run/" in folders
    missing = unnamed_folders(PAGE.read_text(), folders)
    assert not missing, f"docs/architecture.md does not name these folders: {missing}"


def test_a_module_the_page_leaves_out_is_named_by_the_check():
    text = "`dmuon/step/phases.py` runs the step; `dmuon.state.rollback.StateRollback` takes it back."
    modules = ["dmuon/step/phases.py", "dmuon/state/rollback.py", "dmuon/step/fast_path.py"]
    assert unnamed_modules(text, modules) == ["dmuon/step/fast_path.py"]


def test_a_longer_name_does_not_name_a_module():
    text = "`dmuon/step/phases_old.py`, `dmuon.step.phases2`, `dmuon/step/phases.pyc`, `olddmuon/step/phases.py`"
    assert unnamed_modules(text, ["dmuon/step/phases.py"]) == ["dmuon/step/phases.py"]


def test_a_folder_named_only_through_its_files_is_named_by_the_check():
    text = "`dmuon/step/phases.py` and `dmuon.step.fast_path`; `dmuon/state/` holds the state."
    assert unnamed_folders(text, ["dmuon/step/", "dmuon/state/"]) == ["dmuon/step/"]
