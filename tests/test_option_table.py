"""DMuon's option table (``dmuon.options.table``) is what every front end and rule reads: the
constructor takes each option with the table's default and check, a group holds the keys the
table gives its kind, a resume applies or refuses each change as the option's row says,
TorchTitan 0.2's ``[optimizer]`` has the fields the table names with DMuon's defaults, 0.3's
factory takes the whole-optimizer options, and the docs hold the table as it is.

Generated from the table: each test runs over every option and reads the row's ``bad`` and
``changed`` values, so a new option needs nothing here."""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dmuon import DMuon, NS_COEFFICIENT_SETS
from dmuon.options.table import (
    ADAMW_KEYS,
    DEFAULTS,
    FACTORY_KWARGS,
    FLAG_KEYS,
    MUON_KEYS,
    OnResume,
    OPTIONS,
    Scope,
)
from dmuon.options.implementation_flags import IMPLEMENTATION_KEYS
from dmuon.tools import option_table
from torchtitan_ext import versions

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
GROUP_SCOPES = (Scope.MUON, Scope.ADAMW, Scope.GROUPS, Scope.FLAG)
# The tests of TorchTitan 0.2's [optimizer] fields (the 0.3 environment runs the rest).
titan02 = pytest.mark.skipif(versions.torchtitan_line() != "0.2", reason="[optimizer] fields need TorchTitan 0.2.x")
# Each row's bad and changed values, by option.
BAD = {o.name: o.bad for o in OPTIONS}
CHANGED = {o.name: o.changed for o in OPTIONS}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8, bias=False))


def stepped(**options) -> DMuon:
    model = net()
    optimizer = DMuon(list(model.named_parameters()), **options)
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
    return optimizer


def test_dmuon_takes_every_option_of_the_table_as_a_keyword_with_its_default():
    parameters = list(inspect.signature(DMuon.__init__).parameters.values())[2:]  # after self, params
    assert sorted(p.name for p in parameters) == sorted(o.name for o in OPTIONS)
    assert {p.name: p.default for p in parameters} == dict(DEFAULTS)


def test_a_group_holds_the_keys_the_table_gives_its_kind():
    muon, adamw = DMuon(list(net().named_parameters())).param_groups
    assert set(muon) - {"params", "param_names", "use_muon"} == set(MUON_KEYS) | {"capturable"}
    assert set(adamw) - {"params", "param_names", "use_muon"} == set(ADAMW_KEYS) | {"capturable"}
    assert set(FLAG_KEYS) == set(IMPLEMENTATION_KEYS)  # torch's flags: on a group that sets them


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_each_option_refuses_a_bad_value_naming_it(option):
    with pytest.raises(ValueError) as refused:
        DMuon(list(net().named_parameters()), **{option.name: BAD[option.name]})
    assert str(refused.value).startswith("DMuon")
    assert option.key in str(refused.value)


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.scope in GROUP_SCOPES], ids=lambda o: o.name)
def test_a_changed_group_option_on_resume_does_what_its_row_says(option):
    saved = stepped().state_dict()
    resumed = stepped(**{option.name: CHANGED[option.name]})
    mine = [group[option.key] for group in resumed.param_groups if option.key in group]
    if option.on_resume is OnResume.REFUSED:
        with pytest.raises(ValueError, match=option.key):
            resumed.load_state_dict(saved)
        return
    resumed.load_state_dict(saved)
    assert [group[option.key] for group in resumed.param_groups if option.key in group] == mine


@titan02
def test_torchtitan_0_2_has_a_field_for_each_option_the_table_names_with_dmuons_default():
    from torchtitan_ext.titan02.config import Optimizer
    from torchtitan_ext.titan02.kwargs import default_of, dmuon_kwargs

    fields = {f.name: f for f in dataclasses.fields(Optimizer)}
    own = [o for o in OPTIONS if o.titan02 in fields]  # TorchTitan's own fields keep TorchTitan's defaults
    for option in own:
        field = fields[option.titan02]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        assert default == default_of(option.name), option.name
    kwargs = dmuon_kwargs(_parsed_optimizer_config())
    for option in own:  # a named coefficient set stands for its triple
        assert NS_COEFFICIENT_SETS.get(kwargs[option.name], kwargs[option.name]) == DEFAULTS[option.name], option.name


def _parsed_optimizer_config():
    """TorchTitan's own ``[optimizer]`` merged with DMuon's fields, as a parsed config has it."""
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(["--job.custom_config_module", "torchtitan_ext"]).optimizer


def test_torchtitan_0_3_takes_the_whole_optimizer_options_as_factory_options():
    options = pytest.importorskip("torchtitan_ext.titan03.options", exc_type=ImportError)
    whole = {o.name for o in OPTIONS if o.scope is Scope.OPTIMIZER}
    assert set(options.FACTORY_OPTIONS) == whole | {options.CAPTURE_STEP}
    assert {o.name for o in OPTIONS if o.titan03 == FACTORY_KWARGS} == whole


def test_the_torchtitan_docs_name_every_0_3_factory_option():
    options = pytest.importorskip("torchtitan_ext.titan03.options", exc_type=ImportError)
    section = (REPO / "docs" / "torchtitan.md").read_text().split("## TorchTitan 0.3.x", 1)[1]
    factory = section.split("whole-optimizer options (", 1)[1].split(" in `optimizer_factory_kwargs_by_name", 1)[0]
    assert {name for name in options.FACTORY_OPTIONS if f"`{name}`" not in factory} == set()


def test_the_docs_hold_the_option_table_as_the_table_makes_it():
    assert option_table.in_docs(option_table.DOCS.read_text()) == option_table.markdown(), (
        "docs/optimizer.md's option table is stale: python -m dmuon.tools.option_table --write")


def test_a_stale_option_table_in_the_docs_is_told_apart():
    text = option_table.DOCS.read_text().replace("| `momentum` | `0.95` |", "| `momentum` | `0.9` |")
    assert option_table.in_docs(text) != option_table.markdown()


@titan02
def test_the_torchtitan_docs_hold_the_0_2_field_table_as_the_config_makes_it():
    from torchtitan_ext.titan02 import field_table

    assert field_table.in_docs(field_table.DOCS.read_text()) == field_table.markdown(), (
        "docs/torchtitan.md's [optimizer] field table is stale: python -m torchtitan_ext.titan02.field_table --write")


@titan02
def test_the_torchtitan_docs_list_every_0_2_field_with_its_default():
    from torchtitan_ext.titan02.config import Optimizer
    from torchtitan_ext.titan02.kwargs import default_of

    rows = {}
    section = (REPO / "docs" / "torchtitan.md").read_text().split("## `[optimizer]` fields", 1)[1].split("\n## ")[0]
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) >= 2 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    fields = {f.name for f in dataclasses.fields(Optimizer)}
    for option in OPTIONS:
        if option.titan02 in fields:
            assert option.titan02 in rows, f"docs/torchtitan.md's [optimizer] table lacks {option.titan02}"
            cell = rows[option.titan02]
            written = None if cell.startswith("unset") else tomllib.loads(f"x = {cell.split('`')[1]}")["x"]
            assert written == default_of(option.name), option.titan02
