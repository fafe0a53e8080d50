"""What the shipped packages may import: the wheel holds dmuon/ and torchtitan_ext/
only (pyproject.toml), so neither may reach into benchmarks/ or tests/, and the
optimizer's runtime does not import the reporting tool dmuon.tools.plan_report; only
dmuon.torch_compat imports or reads torch's private names; and torchtitan_ext/ and
benchmarks/ reach dmuon through its public surface only: three modules, and of them only
the names each exports in ``__all__`` (docs/development.md, "The public surface").

Read from the source files' import statements (``tests/source_imports.py``). The
layers inside dmuon/ have their own test, tests/test_layers.py.
"""

from __future__ import annotations

import ast
import importlib

import pytest

from tests.source_imports import REPO
from tests.source_imports import imports_of as _imports
from tests.source_imports import module_name as _module_name
from tests.source_imports import sources as _sources
from tests.source_imports import within as _within

pytestmark = pytest.mark.unit

SHIPPED = ("dmuon", "torchtitan_ext")
NOT_SHIPPED = ("benchmarks", "tests")
TOOLS_IN_DMUON = ("dmuon.tools.plan_report", "dmuon.tools.dry_run")
# The one module allowed to import torch's private names (those with a part starting "_").
TORCH_COMPAT = "dmuon.torch_compat"
# dmuon's public surface: the only modules of dmuon that the integrations and benchmarks import.
PUBLIC = ("dmuon", "dmuon.options", "dmuon.tools")
CLIENTS = ("torchtitan_ext", "benchmarks")


def test_imports_are_read_from_the_source_including_relative_ones():
    assert "dmuon.plan.owner_plan" in _imports(REPO / "dmuon" / "optimizer.py")
    assert "torchtitan_ext.titan02.config" in _imports(REPO / "torchtitan_ext" / "__init__.py")
    assert "torchtitan_ext.corpus" in _imports(REPO / "torchtitan_ext" / "datasets.py")


@pytest.mark.parametrize("package", SHIPPED)
def test_no_shipped_module_imports_the_benchmarks_or_the_tests(package):
    sources = _sources(package)
    assert sources, f"no sources found under {package}/"
    offenders = {_module_name(path): sorted(n for n in _imports(path) if _within(n, NOT_SHIPPED))
                 for path in sources}
    assert {module: names for module, names in offenders.items() if names} == {}


def test_the_optimizer_runtime_does_not_import_the_reporting_tool():
    sources = [path for path in _sources("dmuon") if not _within(_module_name(path), TOOLS_IN_DMUON)]
    assert sources
    offenders = {_module_name(path): sorted(n for n in _imports(path) if _within(n, TOOLS_IN_DMUON))
                 for path in sources}
    assert {module: names for module, names in offenders.items() if names} == {}


def _private_torch(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "torch" and any(part.startswith("_") for part in parts)


def test_only_torch_compat_imports_private_torch_names():
    assert _private_torch("torch.distributed.tensor._utils") and not _private_torch("torch.optim.adamw.adamw")
    offenders = {_module_name(path): sorted(n for n in _imports(path) if _private_torch(n))
                 for package in SHIPPED + ("benchmarks",) for path in _sources(package)}
    assert offenders[TORCH_COMPAT]
    assert {module: names for module, names in offenders.items() if names and module != TORCH_COMPAT} == {}


# The private torch names a module besides torch_compat may read: torch.optim's own list ops
# (``torch._foreach_*``), which the update rules call as torch.optim's foreach forms do.
LIST_OPS = "_foreach_"


def _private_torch_reads(path) -> list[str]:
    """``"module:line torch._name"`` for each read of a private attribute of ``torch`` itself."""
    return [f"{_module_name(path)}:{node.lineno} torch.{node.attr}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def test_outside_torch_compat_only_torch_optims_list_ops_are_read_from_torch():
    reads = [read for package in SHIPPED + ("benchmarks",) for path in _sources(package)
             if _module_name(path) != TORCH_COMPAT for read in _private_torch_reads(path)]
    assert any(LIST_OPS in read for read in reads)  # the rules' list ops are seen
    assert [read for read in reads if not read.split(" torch.")[1].startswith(LIST_OPS)] == []


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _dmuon_imports(path) -> dict[str, set[str]]:
    """``{dmuon module: the names imported from it}`` for one source file (``import dmuon.x``: no names)."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and _within(node.module, ("dmuon",)) and not node.level:
            names = found.setdefault(node.module, set())
            for alias in node.names:
                if _is_module(f"{node.module}.{alias.name}"):
                    found.setdefault(f"{node.module}.{alias.name}", set())
                else:
                    names.add(alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, ("dmuon",)):
                    found.setdefault(alias.name, set())
    return found


@pytest.mark.parametrize("package", CLIENTS)
def test_the_integrations_and_benchmarks_import_only_the_public_modules_and_their_exported_names(package):
    used: dict[str, set[str]] = {}
    for path in _sources(package):
        for module, names in _dmuon_imports(path).items():
            used.setdefault(module, set()).update(names)
    assert used, f"{package}/ imports nothing of dmuon"
    assert sorted(set(used) - set(PUBLIC)) == []
    unexported = {module: sorted(names - set(importlib.import_module(module).__all__))
                  for module, names in used.items()}
    assert {module: names for module, names in unexported.items() if names} == {}


def test_an_import_of_a_private_module_or_an_unexported_name_is_seen(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("from dmuon.step.telemetry import StepFigures\nfrom dmuon import tools, DMuon\n")
    assert _dmuon_imports(source) == {"dmuon.step.telemetry": {"StepFigures"}, "dmuon": {"DMuon"},
                                      "dmuon.tools": set()}


def test_every_public_name_is_importable():
    for module in PUBLIC:
        public = importlib.import_module(module)
        assert [name for name in public.__all__ if not hasattr(public, name)] == []


def private_torch_reads(path) -> list[str]:
    """``"line expression"`` for each read of a private torch attribute (``torch.x._y``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and not node.attr.startswith("__"):
            dotted = ast.unparse(node)
            if _private_torch(dotted):
                found.append(f"{node.lineno} {dotted}")
    return found


def test_a_private_torch_read_is_seen(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import torch\nf = torch.distributed._functional_collectives.wait\nv = torch.__version__\n")
    assert private_torch_reads(source)[0] == "2 torch.distributed._functional_collectives.wait"


@pytest.mark.parametrize("package", CLIENTS)
def test_the_integrations_and_benchmarks_read_no_private_torch_name(package):
    offenders = {_module_name(path): reads for path in _sources(package) if (reads := private_torch_reads(path))}
    assert offenders == {}
