"""What the shipped packages may import: the wheel holds dmuon/ and torchtitan_ext/
only (pyproject.toml), so neither may reach into benchmarks/ or tests/, and the
optimizer's runtime does not import the reporting tool dmuon.tools.plan_report; and only
dmuon.torch_compat imports torch's private names.

Read from the source files' import statements (``tests/source_imports.py``). The
layers inside dmuon/ have their own test, tests/test_layers.py.
"""

from __future__ import annotations

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
