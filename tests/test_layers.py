"""dmuon's layers, kept by a test: each folder is one layer, and a layer imports only the
layers below it.

    numerics  <  plan  <  exchange  <  attention                 (the layers)
      <  options  <  state  <  step  <  dmuon.optimizer  <  capture  (the optimizer)
      <  the package (dmuon/__init__.py, the public surface)  <  tools

``dmuon.torch_compat`` is the floor beneath them all: it imports no dmuon module, and any
layer may import it (it is where torch's private names live). The optimizer's own folders
are floors too: its options, then its state, then its step, then the ``DMuon`` class
(``dmuon.optimizer``), then the captured step that wraps a built DMuon, then the package's
``__init__``, which exports both (docs/development.md, "The public surface"). The tools users
call, ``dmuon.tools.plan_report`` and ``dmuon.tools.dry_run``, sit on top; nothing in the runtime imports them (tests/test_package_boundaries.py). The
exchange is the only layer that issues collectives. Read from the source (``ast``), so an
import inside a function counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.source_imports import REPO, imports_of, module_name, sources, within

pytestmark = pytest.mark.unit

FLOOR = "dmuon.torch_compat"
# The layer folders, lowest first.
LAYERS = ("dmuon.numerics", "dmuon.plan", "dmuon.exchange", "dmuon.attention")
# The optimizer's floors, lowest first: its folders below the DMuon class, the class
# (``dmuon.optimizer`` and the package itself), and the captured step above it.
OPTIMIZER_FLOORS = ("dmuon.options", "dmuon.state", "dmuon.step", "dmuon", "dmuon.capture")
OPTIMIZER = "dmuon"  # the DMuon class: dmuon.optimizer
PACKAGE = "dmuon"  # the package's __init__: the public surface, above the captured step
TOOLS = ("dmuon.tools",)
# The folders every runtime module lives in: the layers and the optimizer's floors.
FOLDERS = LAYERS + tuple(floor for floor in OPTIMIZER_FLOORS if floor != OPTIMIZER)
# What dmuon/ itself holds besides those folders and the tools: the class, the package and the floor.
TOP_LEVEL_MODULES = {"__init__", "optimizer", "torch_compat"}
# The most lines a runtime module (every module of dmuon/ but the tools) may have: room for
# one concern in one file (split by concern, never by length).
MAX_MODULE_LINES = 400
# torch.distributed calls that talk to other ranks (or make a group, which every member must call).
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier", "new_group",
    "new_subgroups", "split_group",
}
# DTensor methods and functions that run collectives on the mesh.
DTENSOR_COLLECTIVES = {"full_tensor", "redistribute", "distribute_tensor"}


def level(module: str) -> tuple[int, str]:
    """Where ``module`` sits: (height, folder). Higher may import lower, and a folder its own."""
    if within(module, (FLOOR,)):
        return 0, FLOOR
    for height, layer in enumerate(LAYERS + OPTIMIZER_FLOORS, start=1):
        if layer != OPTIMIZER and within(module, (layer,)):
            return height, layer
    if module == PACKAGE:
        return len(LAYERS) + len(OPTIMIZER_FLOORS) + 1, "the package"
    if within(module, TOOLS):
        return len(LAYERS) + len(OPTIMIZER_FLOORS) + 2, "the tools"
    return len(LAYERS) + 1 + OPTIMIZER_FLOORS.index(OPTIMIZER), OPTIMIZER


def upward_imports(imports: dict[str, set[str]]) -> list[str]:
    """``"a imports b: <b's folder> is not below <a's folder>"`` for each import of a dmuon module that is not
    below the importer's layer (nor in its own folder)."""
    found = []
    for module, names in sorted(imports.items()):
        height, folder = level(module)
        for name in sorted(n for n in names if within(n, ("dmuon",))):
            if name == PACKAGE and module != PACKAGE and height < level(PACKAGE)[0]:
                found.append(f"{module} imports the dmuon package (the public surface) from {folder}")
                continue
            other_height, other_folder = level(name)
            if other_height > height or (other_height == height and other_folder != folder):
                found.append(f"{module} imports {name}: {other_folder} {verb(other_folder)} not below {folder}")
    return found


def verb(folder: str) -> str:
    return "are" if folder == "the tools" else "is"


def collective_calls(path: Path, source: str | None = None) -> list[str]:
    """``"module:line name"`` for each collective a module calls (``dist.all_reduce(...)``,
    ``torch.distributed.new_group(...)``, ``x.full_tensor()``, ``distribute_tensor(...)``)."""
    tree = ast.parse(path.read_text() if source is None else source)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        on_dist = isinstance(func, ast.Attribute) and ast.unparse(func.value) in ("dist", "torch.distributed")
        if (on_dist and name in COLLECTIVES) or name in DTENSOR_COLLECTIVES:
            found.append(f"{module_name(path)}:{node.lineno} {name}")
    return found


def _runtime_sources() -> list[Path]:
    return [path for path in sources("dmuon") if not within(module_name(path), TOOLS)]


def test_each_layer_imports_only_the_layers_below_it():
    imports = {module_name(path): imports_of(path) for path in sources("dmuon")}
    assert set(LAYERS) <= set(imports), "a layer folder is missing"
    assert upward_imports(imports) == []


def test_an_import_of_a_higher_layer_is_named():
    assert upward_imports({"dmuon.numerics.newton_schulz": {"dmuon.plan.units"}}) == [
        "dmuon.numerics.newton_schulz imports dmuon.plan.units: dmuon.plan is not below dmuon.numerics"]
    assert upward_imports({"dmuon.plan.units": {"dmuon.exchange.comm", "dmuon.numerics.newton_schulz"}}) == [
        "dmuon.plan.units imports dmuon.exchange.comm: dmuon.exchange is not below dmuon.plan"]
    assert upward_imports({"dmuon.exchange.comm": {"dmuon.optimizer"}}) == [
        "dmuon.exchange.comm imports dmuon.optimizer: dmuon is not below dmuon.exchange"]
    assert upward_imports({"dmuon.exchange.comm": {"dmuon.attention.qk_clip"}}) == [
        "dmuon.exchange.comm imports dmuon.attention.qk_clip: dmuon.attention is not below dmuon.exchange"]
    assert upward_imports({"dmuon.optimizer": {"dmuon.tools.dry_run.run"}}) == [
        "dmuon.optimizer imports dmuon.tools.dry_run.run: the tools are not below dmuon"]
    assert upward_imports({"dmuon.step.phases": {"dmuon.optimizer"}}) == [
        "dmuon.step.phases imports dmuon.optimizer: dmuon is not below dmuon.step"]
    assert upward_imports({"dmuon.options.checks": {"dmuon.state.kept_state"}}) == [
        "dmuon.options.checks imports dmuon.state.kept_state: dmuon.state is not below dmuon.options"]
    assert upward_imports({"dmuon.optimizer": {"dmuon.capture.cuda_graphs"}}) == [
        "dmuon.optimizer imports dmuon.capture.cuda_graphs: dmuon.capture is not below dmuon"]
    assert upward_imports({"dmuon.torch_compat": {"dmuon.numerics.newton_schulz"}}) == [
        "dmuon.torch_compat imports dmuon.numerics.newton_schulz: dmuon.numerics is not below dmuon.torch_compat"]


def test_a_layer_may_import_its_own_folder_the_floor_and_the_layers_below():
    assert upward_imports({
        "dmuon.plan.owner_plan": {"dmuon.plan.units", "dmuon.numerics.newton_schulz", "dmuon.torch_compat"},
        "dmuon.exchange.comm": {"dmuon.plan.owner_plan", "dmuon.numerics.newton_schulz"},
        "dmuon.attention.clipping": {"dmuon.exchange.groups", "dmuon.plan.layout"},
        "dmuon.optimizer": {"dmuon.attention.clipping", "dmuon.step.fast_path", "dmuon.options.checks"},
        "dmuon.step.phases": {"dmuon.state.rollback", "dmuon.options.param_groups", "dmuon.exchange.comm"},
        "dmuon.capture.cuda_graphs": {"dmuon.optimizer", "dmuon.options.device_hyperparameters"},
        "dmuon.tools.dry_run.run": {"dmuon.optimizer", "dmuon.tools.plan_report"},
    }) == []


def test_nothing_in_dmuon_imports_the_integrations_the_benchmarks_or_the_tests():
    offenders = {module_name(path): sorted(n for n in imports_of(path)
                                           if within(n, ("torchtitan_ext", "benchmarks", "tests")))
                 for path in sources("dmuon")}
    assert {module: names for module, names in offenders.items() if names} == {}


def test_only_the_exchange_issues_collectives():
    outside = [call for path in _runtime_sources() if not within(module_name(path), ("dmuon.exchange",))
               for call in collective_calls(path)]
    assert outside == []
    assert collective_calls(REPO / "dmuon" / "exchange" / "comm.py"), "the exchange's collectives are not seen"


def test_a_collective_outside_the_exchange_is_named():
    path = REPO / "dmuon" / "step" / "telemetry.py"
    source = "import torch.distributed as dist\n\ndef f(t, d):\n    dist.all_reduce(t)\n    return d.full_tensor()\n"
    assert collective_calls(path, source) == ["dmuon.step.telemetry:4 all_reduce", "dmuon.step.telemetry:5 full_tensor"]


def test_dmuon_holds_the_class_the_floor_the_folders_and_the_tools_only():
    modules = {path.stem for path in (REPO / "dmuon").glob("*.py")}
    folders = {path.name for path in (REPO / "dmuon").iterdir() if (path / "__init__.py").exists()}
    assert modules == TOP_LEVEL_MODULES
    assert folders == {folder.split(".")[1] for folder in FOLDERS + TOOLS}


@pytest.mark.parametrize("layer", FOLDERS + TOOLS)
def test_each_layer_folder_says_what_it_holds_and_what_it_may_import(layer):
    init = REPO / Path(*layer.split(".")) / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert "May import:" in docstring
    for path in sorted(init.parent.glob("*.py")):
        if path.name != "__init__.py":
            assert f"``{path.stem}``" in docstring, f"{layer}'s docstring does not list {path.stem}"


def test_no_runtime_module_is_over_the_line_limit():
    long = {module_name(p): n for p in _runtime_sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def import_circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each import circle among ``imports``' keys (strongly connected
    components of more than one module, each sorted), type-only imports included: an import
    under ``if TYPE_CHECKING:`` is still read from the source."""
    graph = {module: sorted(n for n in names if n in imports and n != module) for module, names in imports.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in graph[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in order:
            visit(module)
    return sorted(circles)


def _module_imports() -> dict[str, set[str]]:
    """Each module of dmuon/ (package ``__init__`` files aside: importing a module runs its
    package's first, so an edge to a package is no circle of the modules) and what it imports."""
    return {module_name(path): imports_of(path) for path in sources("dmuon") if path.name != "__init__.py"}


def test_no_two_modules_of_dmuon_import_each_other_even_for_types_only():
    assert import_circles(_module_imports()) == []


def test_an_import_circle_is_named_with_its_modules():
    imports = {"dmuon.plan.owners": {"dmuon.plan.owner_plan"}, "dmuon.plan.owner_plan": {"dmuon.plan.schedule"},
               "dmuon.plan.schedule": {"dmuon.plan.owners"}, "dmuon.plan.units": set()}
    assert import_circles(imports) == [["dmuon.plan.owner_plan", "dmuon.plan.owners", "dmuon.plan.schedule"]]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dmuon.optimizer import DMuon\n"
    assert "dmuon.optimizer" in imports_of(REPO / "dmuon" / "step" / "phases.py", source)  # a type-only import counts


def private_reads(path: Path, source: str | None = None) -> list[str]:
    """``"module:line expression"`` for each read of another object's private attribute
    (``x._name`` where ``x`` is not ``self`` or ``cls``): a module reaches another's state
    only through what that object makes public. torch's own private names live in
    ``dmuon.torch_compat``, the one module allowed them (tests/test_package_boundaries.py)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "torch"))):
            found.append(f"{module_name(path)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_of_dmuon_reads_another_objects_private_attributes():
    outside = [read for path in sources("dmuon") if module_name(path) != FLOOR for read in private_reads(path)]
    assert outside == []


def test_a_private_read_is_named():
    source = "def f(optimizer, self):\n    self._x = 1\n    return optimizer._fast_path._run\n"
    assert private_reads(REPO / "dmuon" / "capture" / "cuda_graphs.py", source) == [
        "dmuon.capture.cuda_graphs:3 optimizer._fast_path._run", "dmuon.capture.cuda_graphs:3 optimizer._fast_path"]
