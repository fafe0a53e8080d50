"""A new boolean group option takes the route docs/development.md ("A new option") gives, and
nothing else: in a copy of the repository, a throwaway option ``route_probe`` gets its row of
the option table, its keyword (and docstring line) in ``DMuon``, its TorchTitan 0.2 field and
its test (it has no rule), the two docs tables are rewritten by their commands, and then the
table's derived checks and the option's test pass: DMuon takes it, a group holds it, a bad
value is refused naming it, a resume applies a change, a copy and a pickle keep it, and
TorchTitan 0.2's field routes a TOML value to the keyword. The files that differ from the
repository's are exactly those."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.launch import run
from torchtitan_ext import versions

pytestmark = [pytest.mark.unit, pytest.mark.skipif(versions.torchtitan_line() != "0.2",
                                                   reason="the route's TorchTitan field is 0.2.x's")]

REPO = Path(__file__).resolve().parents[1]
NAME = "route_probe"
# (file, the start of a line of it, what the route puts before that line)
EDITS = (
    ("dmuon/options/table.py", '    Option("qk_clip_threshold", ',
     f'    Option("{NAME}", False, Scope.MUON, c.check_bool, OnResume.APPLIED, "{NAME}", GROUP_KWARGS,\n'
     '           "the route test\'s throwaway option", bad="yes", changed=True),\n'),
    ("dmuon/optimizer.py", '        qk_clip_threshold: float | None = D["qk_clip_threshold"],',
     f'        {NAME}: bool = D["{NAME}"],\n'),
    ("dmuon/optimizer.py", "        qk_clip_threshold: QK-clip", f"        {NAME}: the route test's throwaway option.\n"),
    ("torchtitan_ext/titan02/config.py", '    momentum_dtype: str = default_of("momentum_dtype")',
     f'    {NAME}: bool = default_of("{NAME}")\n    """The route test\'s throwaway option."""\n\n'),
)
# The option's own test: the route's fifth file.
OPTION_TEST = textwrap.dedent(f'''
    import copy
    import pickle

    import pytest
    import torch
    from torch import nn
    from torchtitan.config.manager import ConfigManager

    from dmuon import DMuon
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs

    pytestmark = pytest.mark.unit
    EXT = ["--job.custom_config_module", "torchtitan_ext", "--experimental.custom_import",
           "torchtitan_ext.titan02.job", "--optimizer.name", "DMuon"]


    def optimizer(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4, bias=False))
        built = DMuon(list(model.named_parameters()), **options)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        built.step()
        return built


    def test_the_option_is_a_muon_group_key_kept_by_a_resume_a_copy_and_a_pickle():
        on = optimizer({NAME}=True)
        assert [g.get("{NAME}") for g in on.param_groups] == [True, None]
        resumed = optimizer({NAME}=True)
        resumed.load_state_dict(on.state_dict())
        for copied in (resumed, copy.deepcopy(on), pickle.loads(pickle.dumps(on))):
            assert copied.param_groups[0]["{NAME}"] is True
        with pytest.raises(ValueError, match="{NAME}"):
            DMuon([nn.Parameter(torch.zeros(4, 4))], {NAME}="yes")


    def test_torchtitan_0_2_routes_its_field_to_the_keyword_and_checks_it(tmp_path):
        assert dmuon_kwargs(ConfigManager().parse_args([*EXT, "--optimizer.{NAME}"]).optimizer)["{NAME}"] is True
        assert dmuon_kwargs(ConfigManager().parse_args(EXT).optimizer)["{NAME}"] is False
        toml = tmp_path / "job.toml"
        toml.write_text('[job]\\ncustom_config_module = "torchtitan_ext"\\n[optimizer]\\nname = "DMuon"\\n'
                        '{NAME} = "yes"\\n')
        with pytest.raises(ValueError, match="{NAME}"):
            ConfigManager().parse_args(["--job.config_file", str(toml)])
''')
OPTION_TEST_PATH = f"tests/test_{NAME}.py"
# The derived checks of tests/test_option_table.py that a new option runs through.
DERIVED = (f"{NAME} or keyword or holds_the_keys or field or docs")
GENERATED = ("docs/optimizer.md", "docs/torchtitan.md")


def _copy_of_the_repository(to: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            (to / name).write_bytes(source.read_bytes())


def _take_the_route(copy: Path) -> None:
    for name, anchor, added in EDITS:
        path = copy / name
        text = path.read_text()
        assert text.count(f"\n{anchor}") == 1, f"{name}: the route's anchor {anchor!r} moved"
        path.write_text(text.replace(f"\n{anchor}", f"\n{added}{anchor}"))
    (copy / OPTION_TEST_PATH).write_text(OPTION_TEST)


def test_a_new_boolean_group_option_needs_its_row_keyword_field_and_test_only(tmp_path):
    copy = tmp_path / "repo"
    _copy_of_the_repository(copy)
    _take_the_route(copy)
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS="1")
    for tool in ("dmuon.tools.option_table", "torchtitan_ext.titan02.field_table"):
        written = run([sys.executable, "-m", tool, "--write"], timeout_s=60, cwd=copy, env=env)
        assert written.returncode == 0, written.stdout
    tests = run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", OPTION_TEST_PATH,
                 "tests/test_option_table.py", "-k", f"{DERIVED} or test_{NAME}"], timeout_s=240, cwd=copy, env=env)
    assert tests.returncode == 0, tests.stdout[-4000:]
    passed = re.search(r"(\d+) passed", tests.stdout)
    assert passed and int(passed.group(1)) >= 10, tests.stdout[-2000:]  # the option's 2, the table's derived ones
    changed = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                     and not ((REPO / p.relative_to(copy)).is_file()
                              and (REPO / p.relative_to(copy)).read_bytes() == p.read_bytes()))
    assert changed == sorted([*{name for name, _, _ in EDITS}, OPTION_TEST_PATH, *GENERATED])
