"""Every dmuon module, name and file the words point at exists: a ``dmuon.x.y`` quoted in
the README, the docs, the TOML comments or any text of dmuon/ and torchtitan_ext/ (error
messages, docstrings, comments) imports, as a module or a name in one; a path such as
``dmuon/plan/units.py`` or ``scripts/demo.sh`` is a file (or ``dmuon/plan/`` a folder);
and ``dmuon/x.py: name`` names something that file defines. So a module that moves
cannot leave a sentence behind."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
TEXTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "train_configs").glob("*.toml")),
         *sorted((REPO / "dmuon").rglob("*.py")), *sorted((REPO / "torchtitan_ext").rglob("*.py"))]
DOTTED = re.compile(r"(?<![\w./-])dmuon(?:\.[A-Za-z_]\w*)+")
# A repository path: a top-level folder of ours, then a file with a suffix or a folder ending in "/".
PATH = re.compile(r"(?<![\w./-])((?:dmuon|torchtitan_ext|benchmarks|scripts|tests|examples|train_configs)/"
                  r"(?:[\w-]+/)*(?:[\w-]+\.(?:py|sh|toml|md)|))(?::\s*`?(\w+))?")


def _quoted(pattern: re.Pattern[str]) -> dict[str, list[str]]:
    """Each match (its first group, or the whole) -> the files that quote it."""
    found: dict[str, list[str]] = {}
    for path in TEXTS:
        for match in pattern.finditer(path.read_text()):
            found.setdefault(match.group(0) if not pattern.groups else match.group(1, 2), []).append(
                str(path.relative_to(REPO)))
    return found


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` imports: its longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def test_every_dmuon_name_quoted_in_the_words_imports():
    quoted = _quoted(DOTTED)
    assert "dmuon.plan.OwnerPlan" in quoted or "dmuon.plan.Unit" in quoted
    assert {name: files for name, files in quoted.items() if not resolves(name.rstrip("."))} == {}


def test_every_repository_path_quoted_in_the_words_exists():
    quoted = _quoted(PATH)
    assert ("dmuon/plan/layout.py", None) in quoted
    missing = {path: files for (path, _), files in quoted.items() if not (REPO / path).exists()}
    assert missing == {}


def test_every_name_quoted_after_a_dmuon_file_is_defined_there():
    quoted = _quoted(PATH)
    wrong = {f"{path}: {name}": files for (path, name), files in quoted.items()
             if name and path.startswith("dmuon/") and path.endswith(".py") and (REPO / path).exists()
             and not defines(REPO / path, name)}
    assert wrong == {}


def test_a_name_or_path_that_moved_is_caught():
    assert resolves("dmuon.plan.units.Unit") and resolves("dmuon.numerics.newton_schulz")
    assert not resolves("dmuon.newton_schulz") and not resolves("dmuon.plan.Nothing")
    assert not (REPO / "dmuon/transport/owner_exchange.py").exists()
    assert defines(REPO / "dmuon/plan/schedule.py", "batch_schedule")
    assert not defines(REPO / "dmuon/plan/owner_plan.py", "batch_schedule")
