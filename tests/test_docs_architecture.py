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

import ast
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


# ---- the table of where each line of the Muon update lives, against the code

RULES = PACKAGE / "numerics" / "update_rules.py"
TABLE_START = "Where each line of the Muon update lives"


def definitions() -> dict[str, ast.AST]:
    """Every function, class and method of dmuon by its name (``momentum_``, ``FastStep.pack_blocks``)."""
    found: dict[str, ast.AST] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                found[node.name] = node
            elif isinstance(node, ast.ClassDef):
                found[node.name] = node
                found.update((f"{node.name}.{item.name}", item) for item in node.body
                             if isinstance(item, ast.FunctionDef))
    return found


def calls(node: ast.AST) -> set[str]:
    """The names a function calls (``f(...)``, ``x.f(...)``: ``f``)."""
    return {call.func.id if isinstance(call.func, ast.Name) else call.func.attr for call in ast.walk(node)
            if isinstance(call, ast.Call) and isinstance(call.func, (ast.Name, ast.Attribute))}


def update_table(text: str) -> list[list[str]]:
    """The rows of the page's table of where each line of the update lives, as cells (no header)."""
    lines = text[text.index(TABLE_START):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in lines[start + 2 : end]]


def chains(cell: str, defined: dict[str, ast.AST]) -> list[list[str]]:
    """Each alternative (``;``) of a cell as the chain of functions it names, in order."""
    return [[name for name in re.findall(r"`([\w.]+)`", part) if name in defined] for part in cell.split(";")]


def test_each_line_of_the_update_is_one_rule_reached_in_at_most_two_calls_as_the_page_says():
    defined, rules = definitions(), {n.name for n in ast.parse(RULES.read_text()).body if isinstance(n, ast.FunctionDef)}
    rows = update_table(PAGE.read_text())
    assert len(rows) >= 8, "the table of where each line of the update lives is gone"
    for line, math, *paths in rows:
        rule = re.match(r"`([\w.]+)`", math)
        rule = rule.group(1) if rule and rule.group(1) in rules else None
        for cell in paths:
            alternatives = [chain for chain in chains(cell, defined) if chain]
            assert alternatives, f"{line}: {cell!r} names no function of dmuon"
            for chain in alternatives:
                assert len(chain) <= 2, f"{line}: {chain} is more than two calls from the step to the rule"
                for caller, callee in zip(chain, chain[1:]):
                    assert callee.split(".")[-1] in calls(defined[caller]), f"{line}: {caller} does not call {callee}"
            if rule is not None:
                assert any(rule in calls(defined[chain[-1]]) or chain[-1] == rule for chain in alternatives), \
                    f"{line}: no path of {cell!r} calls update_rules.{rule}"


def test_a_table_path_that_does_not_reach_its_rule_is_named():
    text = (f"{TABLE_START}\n\n| line | math | on | off |\n| --- | --- | --- | --- |\n"
            "| momentum | `momentum_` | `FastStep.pack_blocks` | `GroupSteps._muon_chunk` |\n\n")
    defined = definitions()
    (row,) = update_table(text)
    assert chains(row[2], defined) == [["FastStep.pack_blocks"]]
    assert "momentum_" not in calls(defined["FastStep.pack_blocks"])
    assert "momentum_" in calls(defined["GroupSteps._muon_chunk"])
