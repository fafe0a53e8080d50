"""One rule per option: ``DMuon(...)`` and TorchTitan's ``[optimizer]`` section check a
value with the same dmuon validator, give the same message (apart from the prefix
naming where: ``DMuon`` / ``[optimizer]``), and start from the same defaults.

In-process: the TOML front end is TorchTitan's own ``ConfigManager.parse_args`` with a
``--optimizer.<field>`` override, as in tests/test_torchtitan_config.py.
"""

from __future__ import annotations

import inspect
import re
import tomllib

import pytest
import torch
import torch.nn as nn
from torchtitan.config import ConfigManager

from dmuon import DMuon, default_use_muon
from dmuon.numerics.newton_schulz import NS_COEFFICIENT_SETS
from dmuon.options.checks import check_comm, check_link_gbps, check_max_batch_numel, check_split_replicas
from dmuon.plan.cost_model import CostModel
from torchtitan_ext.routing import goes_to_adamw, route_parameters
from torchtitan_ext.titan02.kwargs import dmuon_kwargs

pytestmark = pytest.mark.unit

EXT = ["--job.custom_config_module", "torchtitan_ext", "--experimental.custom_import", "torchtitan_ext.titan02.job"]
# (TOML field, command-line value, DMuon keyword, the same value as DMuon takes it)
BAD_VALUES = [
    ("momentum", "1.5", "momentum", 1.5),
    ("momentum", "-0.1", "momentum", -0.1),
    ("ns_steps", "0", "ns_steps", 0),
    ("ns_steps", "100", "ns_steps", 100),  # the TOML front end once took any ns_steps >= 1
    ("ns_coefficients", "nope", "ns_coefficients", "nope"),
    ("adjust_lr", "sqrt", "adjust_lr", "sqrt"),
    ("matched_adamw_rms", "0", "matched_adamw_rms", 0.0),
    ("lr", "-1", "lr", -1.0),
    ("weight_decay", "-0.1", "weight_decay", -0.1),
    # adamw_lr, beta1 and beta2 are named as the TOML spells them, not as DMuon's keywords:
    # tests/test_torchtitan_field_checks.py.
    ("eps", "-1", "adamw_eps", -1.0),
    ("lr", "inf", "lr", float("inf")),  # finite numbers only: an infinite lr makes NaN weights
    ("weight_decay", "inf", "weight_decay", float("inf")),
    ("eps", "inf", "adamw_eps", float("inf")),
    ("matched_adamw_rms", "inf", "matched_adamw_rms", float("inf")),
    ("normuon_beta2", "1.0", "normuon_beta2", 1.0),  # the EMA would never move
    ("normuon_beta2", "-0.1", "normuon_beta2", -0.1),
    ("ns_dtype", "fp16", "ns_dtype", "fp16"),
    ("momentum_dtype", "fp8", "momentum_dtype", "fp8"),
    ("comm", "nccl", "comm", "nccl"),
    ("split_replicas", "sometimes", "split_replicas", "sometimes"),
    ("link_gbps", "0", "link_gbps", 0.0),
    ("replica_link_gbps", "inf", "replica_link_gbps", float("inf")),
]


# The fields whose TOML spellings differ from DMuon's Python values.
TOML_SPELLINGS = {"adjust_lr": "'original', 'match_rms_adamw', 'spectral', 'none'",
                  "split_replicas": "'auto', 'always', 'never'", "momentum_dtype": "'param', 'bfloat16', 'int8'"}


def message_of(build) -> str:
    with pytest.raises(ValueError) as error:
        build()
    return str(error.value)


def without_where(message: str, where: str) -> str:
    assert message.startswith(where), f"{message!r} does not start with {where!r}"
    return message[len(where):]


@pytest.mark.parametrize(("field", "text", "keyword", "value"), BAD_VALUES)
def test_a_bad_value_gets_the_same_message_from_dmuon_and_from_the_toml_section(field, text, keyword, value):
    from_dmuon = message_of(lambda: DMuon([nn.Parameter(torch.zeros(4, 4))], **{keyword: value}))
    from_toml = message_of(lambda: ConfigManager().parse_args([*EXT, "--optimizer.name", "DMuon",
                                                               f"--optimizer.{field}={text}"]))
    # The same message; where TOML spells values differently ("none", "auto"), it names them too.
    toml_rule, dmuon_rule = without_where(from_toml, "[optimizer]"), without_where(from_dmuon, "DMuon")
    spellings = TOML_SPELLINGS.get(field)
    assert toml_rule == (f"{dmuon_rule}; in TOML, {field} is one of {spellings}" if spellings else dmuon_rule)


# (TOML field, a value that is not a bool): the on/off fields. tyro reads a command-line
# bool itself (a flag), so these come from a TOML file, which TorchTitan passes on as written.
NOT_BOOLS = [("nesterov", "1"), ("normuon", "1"), ("normuon", '"yes"'), ("cautious_weight_decay", "0")]


@pytest.mark.parametrize(("field", "text"), NOT_BOOLS)
def test_a_non_bool_on_off_value_gets_the_same_message_from_dmuon_and_from_a_toml_file(tmp_path, field, text):
    value = tomllib.loads(f"x = {text}")["x"]
    from_dmuon = message_of(lambda: DMuon([nn.Parameter(torch.zeros(4, 4))], **{field: value}))
    path = tmp_path / "job.toml"
    path.write_text('[job]\ncustom_config_module = "torchtitan_ext"\n[experimental]\n'
                    f'custom_import = "torchtitan_ext.titan02.job"\n[optimizer]\nname = "DMuon"\n{field} = {text}\n')
    from_toml = message_of(lambda: ConfigManager().parse_args(["--job.config_file", str(path)]))
    assert without_where(from_toml, "[optimizer]") == without_where(from_dmuon, "DMuon")


@pytest.mark.parametrize(("check", "keyword", "value"), [
    (check_comm, "comm", "nccl"),
    (check_max_batch_numel, "max_batch_numel", 0),
    (check_split_replicas, "split_replicas", "sometimes"),
])
def test_the_whole_optimizer_checks_in_param_groups_say_what_dmuon_says(check, keyword, value):
    # DMuon.__init__ still runs its own copies of these checks; this keeps the two
    # saying the same thing until it calls the shared ones.
    assert message_of(lambda: check(value, "DMuon")) == message_of(
        lambda: DMuon([nn.Parameter(torch.zeros(4, 4))], **{keyword: value}))


@pytest.mark.parametrize("value", [400, 12.5, 1e-3])
def test_a_positive_finite_link_speed_is_taken_as_a_float(value):
    assert check_link_gbps(value, "link_gbps", "DMuon") == float(value)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "400", None])
def test_a_link_speed_that_is_not_a_positive_finite_number_is_rejected_naming_it(value):
    expected = f"[optimizer]: replica_link_gbps must be a positive finite number of Gbit/s, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        check_link_gbps(value, "replica_link_gbps", "[optimizer]")


def test_the_toml_defaults_are_dmuons_defaults():
    """Every ``[optimizer]`` field mapped onto a DMuon keyword defaults to what DMuon
    defaults to (lr, betas and eps are TorchTitan's own fields, with its defaults, and so is
    implementation, which makes foreach and fused)."""
    signature = inspect.signature(DMuon).parameters
    kwargs = dmuon_kwargs(ConfigManager().parse_args(EXT).optimizer)
    torchtitan_owned = {"lr", "adamw_betas", "adamw_eps", "weight_decay", "adamw_lr", "foreach", "fused"}
    compared = set()
    for keyword, value in kwargs.items():
        if keyword in torchtitan_owned or keyword not in signature:
            continue
        default = signature[keyword].default
        if keyword == "ns_coefficients":  # the TOML names the schedule DMuon holds as numbers
            value = NS_COEFFICIENT_SETS[value]
        assert value == default, keyword
        compared.add(keyword)
    assert {"momentum", "nesterov", "ns_steps", "ns_coefficients", "adjust_lr", "matched_adamw_rms", "normuon",
            "normuon_beta2", "cautious_weight_decay", "momentum_dtype", "comm", "split_replicas", "ns_dtype",
            "telemetry"} <= compared


def test_the_link_speed_fields_default_to_the_cost_models_speeds():
    cfg = ConfigManager().parse_args(EXT).optimizer
    assert (cfg.link_gbps, cfg.replica_link_gbps) == (CostModel().link_gbps, CostModel().replica_link_gbps)


def test_the_link_speed_fields_are_read_from_the_command_line():
    cfg = ConfigManager().parse_args([*EXT, "--optimizer.link_gbps", "200",
                                      "--optimizer.replica_link_gbps", "25"]).optimizer
    assert (cfg.link_gbps, cfg.replica_link_gbps) == (200.0, 25.0)


def test_the_link_speeds_reach_dmuon_under_the_same_names():
    cfg = ConfigManager().parse_args([*EXT, "--optimizer.link_gbps", "200",
                                      "--optimizer.replica_link_gbps", "25"]).optimizer
    kwargs = dmuon_kwargs(cfg)
    assert (kwargs["link_gbps"], kwargs["replica_link_gbps"]) == (200.0, 25.0)
    DMuon([nn.Parameter(torch.zeros(4, 4))], **kwargs)


ROUTING_CASES = [
    ("layers.0.attention.wq.weight", torch.zeros(4, 4)),
    ("layers.0.attention_norm.weight", torch.zeros(4)),
    ("layers.0.feed_forward.w1.bias", torch.zeros(4)),
    ("tok_embeddings.weight", torch.zeros(8, 4)),
    ("output.weight", torch.zeros(8, 4)),
    ("layers.0.moe.experts.w1", torch.zeros(2, 4, 4)),
    ("scalar", torch.zeros(())),
    ("layers.0.rotary.weight", torch.zeros(4, 4, dtype=torch.complex64)),
]


@pytest.mark.parametrize(("name", "tensor"), ROUTING_CASES, ids=[n for n, _ in ROUTING_CASES])
def test_torchtitan_routes_a_parameter_as_dmuons_default_rule_does(name, tensor):
    regex = r"(^|\.)(tok_embeddings|output)\.|norm"
    assert goes_to_adamw(name, nn.Parameter(tensor), re.compile(regex)) == (not default_use_muon(name, tensor, regex))


def test_a_complex_matrix_goes_to_the_adamw_group_in_torchtitan():
    model = nn.Module()
    model.real = nn.Parameter(torch.zeros(4, 4))
    model.spectrum = nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
    routed = route_parameters(model, r"^$")
    assert ([n for n, _ in routed.muon], [n for n, _ in routed.adamw]) == (["real"], ["spectrum"])
