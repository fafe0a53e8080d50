"""Specification of the ``[optimizer]`` extension as TorchTitan's config parser sees it.

In-process and fast: these parse configs with TorchTitan's own ``ConfigManager``,
exactly as ``torchtitan.train`` does, without launching training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchtitan.config import ConfigManager

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"
EXT = ["--job.custom_config_module", "torchtitan_ext", "--experimental.custom_import", "torchtitan_ext.titan02.job"]


def parse(*args: str):
    return ConfigManager().parse_args(list(args))


def toml_with(tmp_path: Path, old: str, new: str, base: str = "llama3_debug_dmuon.toml") -> Path:
    """A copy of a shipped TOML with one line replaced."""
    text = (CONFIGS / base).read_text()
    assert old in text, f"{old!r} not in {base}"
    path = tmp_path / "job.toml"
    path.write_text(text.replace(old, new))
    return path


def test_dmuon_fields_are_added_to_the_optimizer_section_with_defaults():
    cfg = parse(*EXT).optimizer
    assert (cfg.momentum, cfg.nesterov, cfg.ns_steps) == (0.95, True, 5)
    assert (cfg.ns_coefficients, cfg.adjust_lr, cfg.matched_adamw_rms) == ("keller", "original", 0.2)
    assert cfg.adamw_lr is None
    assert cfg.comm == "all_to_all"
    assert cfg.name == "AdamW"  # TorchTitan's own default is untouched


def test_stock_optimizer_fields_keep_their_torchtitan_defaults():
    cfg = parse(*EXT).optimizer
    assert (cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay) == (8e-4, 0.9, 0.95, 1e-8, 0.1)


@pytest.mark.parametrize("name", ["llama3_debug_dmuon.toml", "llama3_debug_adamw.toml", "llama3_8b_dmuon.toml"])
def test_every_shipped_config_parses(name):
    cfg = parse("--job.config_file", str(CONFIGS / name))
    assert cfg.job.custom_config_module == "torchtitan_ext"


def test_the_demo_toml_sets_the_dmuon_fields():
    cfg = parse("--job.config_file", str(CONFIGS / "llama3_debug_dmuon.toml")).optimizer
    assert cfg.name == "DMuon"
    assert (cfg.lr, cfg.adamw_lr) == (0.02, 2e-3)


def test_telemetry_is_off_by_default_and_on_in_the_cpu_demo():
    assert parse(*EXT).optimizer.telemetry is False
    assert parse("--job.config_file", str(CONFIGS / "llama3_debug_dmuon.toml")).optimizer.telemetry is True


def test_telemetry_set_in_toml_can_be_turned_off_on_the_command_line():
    cfg = parse("--job.config_file", str(CONFIGS / "llama3_debug_dmuon.toml"), "--optimizer.no-telemetry")
    assert cfg.optimizer.telemetry is False


def test_command_line_overrides_a_dmuon_field():
    cfg = parse("--job.config_file", str(CONFIGS / "llama3_debug_dmuon.toml"), "--optimizer.ns_steps", "4")
    assert cfg.optimizer.ns_steps == 4


def test_unknown_adjust_lr_in_a_toml_file_is_rejected_naming_the_section(tmp_path):
    path = toml_with(tmp_path, 'adjust_lr = "original"', 'adjust_lr = "sqrt"')
    with pytest.raises(ValueError, match=r"^\[optimizer\]: unknown adjust_lr 'sqrt'"):
        parse("--job.config_file", str(path))


def test_ns_dtype_defaults_to_auto_and_is_set_in_the_shipped_dmuon_configs():
    assert parse(*EXT).optimizer.ns_dtype == "auto"
    for name in ("llama3_debug_dmuon.toml", "llama3_8b_dmuon.toml"):
        assert parse("--job.config_file", str(CONFIGS / name)).optimizer.ns_dtype == "auto"


def test_unknown_ns_dtype_is_rejected_with_dmuons_own_message_naming_the_section(tmp_path):
    from dmuon.options.checks import check_ns_dtype

    with pytest.raises(ValueError) as rule:
        check_ns_dtype("fp16", "[optimizer]")
    path = toml_with(tmp_path, 'ns_dtype = "auto"', 'ns_dtype = "fp16"')
    with pytest.raises(ValueError) as from_toml:
        parse("--job.config_file", str(path))
    assert str(from_toml.value) == str(rule.value)


def test_invalid_regex_is_rejected_naming_the_toml_key(tmp_path):
    path = toml_with(tmp_path, "adamw_param_regex = '", "adamw_param_regex = '(unclosed|")
    with pytest.raises(ValueError, match=r"\[optimizer\] adamw_param_regex = .* is not a valid"):
        parse("--job.config_file", str(path))


def test_early_step_in_backward_is_rejected_with_dmuon(tmp_path):
    path = toml_with(tmp_path, 'name = "DMuon"', 'name = "DMuon"\nearly_step_in_backward = true')
    with pytest.raises(ValueError, match=r"\[optimizer\] early_step_in_backward = true is not supported"):
        parse("--job.config_file", str(path))


def test_early_step_in_backward_stays_allowed_for_adamw():
    cfg = parse(*EXT, "--optimizer.name", "AdamW", "--optimizer.early_step_in_backward")
    assert cfg.optimizer.early_step_in_backward


def test_unknown_ns_coefficient_set_is_rejected_naming_the_section():
    with pytest.raises(ValueError, match=r"^\[optimizer\]: unknown ns_coefficients 'nope'"):
        parse(*EXT, "--optimizer.name", "DMuon", "--optimizer.ns_coefficients", "nope")


def test_dmuon_settings_are_not_checked_when_another_optimizer_is_chosen():
    cfg = parse(*EXT, "--optimizer.name", "AdamW", "--optimizer.adjust_lr", "whatever")
    assert cfg.optimizer.adjust_lr == "whatever"


@pytest.mark.parametrize("name", ["llama3_debug_dmuon.toml", "llama3_8b_dmuon.toml"])
def test_shipped_configs_spell_out_the_default_adamw_regex(name):
    from torchtitan_ext.titan02.config import DEFAULT_ADAMW_PARAM_REGEX

    cfg = parse("--job.config_file", str(CONFIGS / name)).optimizer
    assert cfg.adamw_param_regex == DEFAULT_ADAMW_PARAM_REGEX


def _write_toml(tmp_path, optimizer_lines: str):
    path = tmp_path / "job.toml"
    path.write_text('[job]\ncustom_config_module = "torchtitan_ext"\n[experimental]\n'
                    'custom_import = "torchtitan_ext.titan02.job"\n[optimizer]\nname = "DMuon"\n' + optimizer_lines)
    return ConfigManager().parse_args(["--job.config_file", str(path)]).optimizer


def test_polar_express_is_chosen_by_name_in_toml(tmp_path):
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs

    cfg = _write_toml(tmp_path, 'ns_coefficients = "polar_express"\n')
    assert dmuon_kwargs(cfg)["ns_coefficients"] == "polar_express"


def test_a_per_iteration_coefficient_list_is_accepted_in_toml(tmp_path):
    import torch

    from dmuon import DMuon
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs

    cfg = _write_toml(tmp_path, "ns_coefficients = [[3.4445, -4.775, 2.0315], [3.0, -3.2, 1.2]]\n")
    optimizer = DMuon([torch.nn.Parameter(torch.zeros(4, 4))], **dmuon_kwargs(cfg))
    assert optimizer.param_groups[0]["ns_coefficients"] == ((3.4445, -4.775, 2.0315), (3.0, -3.2, 1.2))


def test_a_malformed_coefficient_list_in_toml_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"^\[optimizer\]: ns_coefficients must be .* got \[\[3.0, -3.2\]\]$"):
        _write_toml(tmp_path, "ns_coefficients = [[3.0, -3.2]]\n")


def test_an_unknown_split_replicas_in_a_toml_file_is_rejected_naming_the_section(tmp_path):
    bad = toml_with(tmp_path, 'split_replicas = "auto"', 'split_replicas = "sometimes"')
    with pytest.raises(ValueError, match=r"^\[optimizer\]: split_replicas must be .* got 'sometimes'; "
                                         r"in TOML, split_replicas is one of 'auto', 'always', 'never'$"):
        parse("--job.config_file", str(bad))


@pytest.mark.parametrize("name", ["llama3_debug_dmuon.toml", "llama3_8b_dmuon.toml"])
def test_shipped_configs_keep_the_update_rule_variants_off(name):
    cfg = parse("--job.config_file", str(CONFIGS / name)).optimizer
    assert (cfg.normuon, cfg.normuon_beta2, cfg.cautious_weight_decay) == (False, 0.95, False)


def test_the_update_rule_variants_reach_dmuons_muon_and_adamw_groups():
    import torch

    from dmuon import DMuon
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs

    cfg = parse(*EXT, "--optimizer.name", "DMuon", "--optimizer.normuon", "--optimizer.normuon_beta2", "0.9",
                "--optimizer.cautious_weight_decay").optimizer
    optimizer = DMuon([("w", torch.nn.Parameter(torch.zeros(4, 4))), ("b", torch.nn.Parameter(torch.zeros(4)))],
                      **dmuon_kwargs(cfg))
    muon, adamw = optimizer.param_groups
    assert (muon["normuon"], muon["normuon_beta2"], muon["cautious_weight_decay"]) == (True, 0.9, True)
    assert adamw["cautious_weight_decay"] is True


@pytest.mark.parametrize("toml, kept", [("param", None), ("bfloat16", "bfloat16"), ("int8", "int8")])
def test_the_momentum_dtype_field_reaches_dmuons_muon_groups(toml, kept):
    import torch

    from dmuon import DMuon
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs

    cfg = parse(*EXT, "--optimizer.name", "DMuon", "--optimizer.momentum_dtype", toml).optimizer
    optimizer = DMuon([("w", torch.nn.Parameter(torch.zeros(4, 4)))], **dmuon_kwargs(cfg))
    assert optimizer.param_groups[0]["momentum_dtype"] == kept


@pytest.mark.parametrize("name", ["llama3_debug_dmuon.toml", "llama3_8b_dmuon.toml"])
def test_shipped_configs_spell_out_the_standard_newton_schulz(name):
    cfg = parse("--job.config_file", str(CONFIGS / name)).optimizer
    assert (cfg.ns_algorithm, list(cfg.ns_gram_restarts)) == ("standard", [2])


def test_gram_newton_schulz_and_its_restarts_reach_dmuons_muon_group(tmp_path):
    import torch

    from dmuon import DMuon
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs

    cfg = _write_toml(tmp_path, 'ns_algorithm = "auto"\nns_gram_restarts = [1, 3]\n')
    optimizer = DMuon([("w", torch.nn.Parameter(torch.zeros(4, 8)))], **dmuon_kwargs(cfg))
    assert (optimizer.param_groups[0]["ns_algorithm"], optimizer.param_groups[0]["ns_gram_restarts"]) == ("auto", (1, 3))


def test_an_unknown_ns_algorithm_in_toml_is_rejected_naming_the_section(tmp_path):
    bad = toml_with(tmp_path, 'ns_algorithm = "standard"', 'ns_algorithm = "fast"')
    with pytest.raises(ValueError, match=r"^\[optimizer\]: ns_algorithm must be one of"):
        parse("--job.config_file", str(bad))


# ----------------------------------------------------------------- implementation
@pytest.mark.parametrize("implementation, flags", [
    ("for-loop", {"foreach": False, "fused": False}),
    ("foreach", {"foreach": True, "fused": False}),
    ("fused", {"foreach": True, "fused": True}),
])
def test_implementation_maps_onto_dmuons_foreach_and_fused(implementation, flags):
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs

    cfg = parse(*EXT, "--optimizer.name", "DMuon", "--optimizer.implementation", implementation).optimizer
    assert {key: dmuon_kwargs(cfg)[key] for key in flags} == flags


def test_fused_implementation_leaves_the_adamw_part_as_list_ops_where_torch_cannot_fuse():
    import torch
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs

    cfg = parse(*EXT, "--optimizer.name", "DMuon").optimizer  # implementation = "fused", TorchTitan's default
    kwargs = dmuon_kwargs(cfg, [torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))])
    assert (kwargs["foreach"], kwargs["fused"]) == (True, False)


def test_an_unknown_implementation_in_a_toml_file_is_rejected_naming_the_field(tmp_path):
    path = toml_with(tmp_path, 'implementation = "fused"', 'implementation = "fastest"')
    with pytest.raises(ValueError, match=r"optimizer\.implementation must be one of \('for-loop', 'foreach', "
                                         r"'fused'\), got 'fastest'"):
        parse("--job.config_file", str(path))


@pytest.mark.parametrize("name", ["llama3_debug_dmuon.toml", "llama3_8b_dmuon.toml"])
def test_shipped_dmuon_configs_spell_out_torchtitans_default_implementation(name):
    default = parse(*EXT).optimizer.implementation
    assert parse("--job.config_file", str(CONFIGS / name)).optimizer.implementation == default == "fused"
