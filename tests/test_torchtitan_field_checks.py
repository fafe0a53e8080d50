"""What a slightly wrong ``[optimizer]`` (0.2.x TOML) is told, and when: each bad value is
refused while TorchTitan parses the config, naming the field as the TOML spells it.

In-process (TorchTitan's own ``ConfigManager.parse_args``), except one launch that shows a
DMuon job parsed without ``custom_config_module`` stop before its model is built. Issue 43,
items 5-8 and 10, and the fault-tolerance refusal.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torchtitan.config import ConfigManager

import torchtitan_ext.titan02.job  # noqa: F401  (registers the DMuon-aware train specs)
from tests.test_torchtitan_container import build, tiny_llama
from tests.titan_runs import ADAMW_TOML, torchrun

HEADER = ('[job]\ncustom_config_module = "torchtitan_ext"\n[experimental]\n'
          'custom_import = "torchtitan_ext.titan02.job"\n[optimizer]\nname = "DMuon"\n')
FLAG = "must be true or false (a boolean, not a string or a number), got "
# (what the TOML says, the whole message it gets)
BAD_TOML = [
    # item 5: on/off fields take TOML booleans only (a string "false" used to turn them on)
    ('telemetry = "false"', f"[optimizer]: telemetry {FLAG}'false'"),
    ('track_max_logits = "false"', f"[optimizer]: track_max_logits {FLAG}'false'"),
    ('split_attention_heads = "false"', f"[optimizer]: split_attention_heads {FLAG}'false'"),
    ("split_attention_heads = 1", f"[optimizer]: split_attention_heads {FLAG}1"),
    ('early_step_in_backward = "no"', f"[optimizer]: early_step_in_backward {FLAG}'no'"),
    ('skip_nonfinite = "true"', f"[optimizer]: skip_nonfinite {FLAG}'true'"),
    ('capture_step = "false"', f"[optimizer]: capture_step {FLAG}'false'"),
    ('nesterov = "true"', "[optimizer]: nesterov must be a bool (True or False), got 'true'"),
    # item 7: numbers must be finite
    ("lr = inf", "[optimizer]: lr must be in [0.0, inf), got inf"),
    ("adamw_lr = inf", "[optimizer]: adamw_lr must be a finite number in [0, inf) (leave it out to use lr), got inf"),
    ("weight_decay = inf", "[optimizer]: weight_decay must be in [0.0, inf), got inf"),
    ("eps = inf", "[optimizer] (AdamW part): eps must be in [0.0, inf), got inf"),
    ("matched_adamw_rms = inf", "[optimizer]: matched_adamw_rms must be in (0.0, inf), got inf"),
    ("momentum = nan", "[optimizer]: momentum must be in [0.0, 1.0), got nan"),
    # item 8: the message names the field the TOML wrote, not DMuon's keyword
    ("adamw_lr = -1", "[optimizer]: adamw_lr must be a finite number in [0, inf) (leave it out to use lr), got -1"),
    ('beta2 = "0.95"', "[optimizer]: beta2 must be a finite number in [0, 1), got '0.95'"),
    ("beta1 = 1.5", "[optimizer]: beta1 must be a finite number in [0, 1), got 1.5"),
    # fault tolerance: refused while parsing, not after the model is built
    ("[fault_tolerance]\nenable = true",
     '[optimizer] name = "DMuon" does not support TorchFT: set [fault_tolerance] enable = false '
     '(or train with name = "AdamW" under fault tolerance).'),
]


def parse_toml(tmp_path: Path, text: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return ConfigManager().parse_args(["--job.config_file", str(path)])


@pytest.mark.unit
@pytest.mark.parametrize(("line", "message"), BAD_TOML, ids=[line.split("\n")[-1] for line, _ in BAD_TOML])
def test_a_bad_toml_value_is_refused_at_parse_time_naming_the_field_as_written(tmp_path, line, message):
    with pytest.raises(ValueError) as error:
        parse_toml(tmp_path, HEADER + line + "\n")
    assert str(error.value) == message


@pytest.mark.unit
@pytest.mark.parametrize("line", ["telemetry = false", "split_attention_heads = true", "adamw_lr = 0.01",
                                  "beta2 = 0.99", "lr = 0"])
def test_a_good_value_of_each_checked_field_still_parses(tmp_path, line):
    parse_toml(tmp_path, HEADER + line + "\n")


@pytest.mark.unit
def test_the_field_checks_are_not_applied_to_another_optimizer(tmp_path):
    cfg = parse_toml(tmp_path, HEADER.replace('"DMuon"', '"AdamW"') + 'telemetry = "false"\nadamw_lr = -1\n')
    assert cfg.optimizer.telemetry == "false"


# ----------------------------------------------------------------- custom_config_module (item 6)


def toml_without_config_module(tmp_path: Path) -> Path:
    """The AdamW demo TOML with name = "DMuon" and no [job] custom_config_module line."""
    text = ADAMW_TOML.read_text()
    line = next(l for l in text.splitlines() if l.startswith("custom_config_module"))
    path = tmp_path / "no_config_module.toml"
    path.write_text(text.replace(line + "\n", "").replace('name = "AdamW"', 'name = "DMuon"'))
    return path


MISSING_CONFIG_MODULE = re.escape('add [job] custom_config_module = "torchtitan_ext" to the TOML')


@pytest.mark.unit
def test_a_dmuon_config_parsed_without_the_config_module_is_refused_by_the_job_module(tmp_path):
    from types import SimpleNamespace

    from torchtitan_ext.titan02.job import importing_job_config
    from torchtitan_ext.titan02.validation import check_config_module_named

    # As TorchTitan parses it without the config half: no DMuon field in [optimizer].
    config = SimpleNamespace(job=SimpleNamespace(custom_config_module=""), optimizer=SimpleNamespace(name="DMuon"))

    class Trainer:  # as TorchTitan's: __init__(self, job_config) imports custom_import first
        def __init__(self, job_config):
            self.found = importing_job_config()

    assert Trainer(config).found is config
    with pytest.raises(ValueError, match=MISSING_CONFIG_MODULE):
        check_config_module_named(config)


@pytest.mark.torchrun
def test_a_dmuon_job_without_the_config_module_stops_before_building_the_model(tmp_path, short_run_args):
    log, out = torchrun(toml_without_config_module(tmp_path), tmp_path / "dump", *short_run_args, nproc=1,
                        check=False)
    assert re.search(MISSING_CONFIG_MODULE, out), out[-3000:]
    assert "Building llama3" not in out and not log.train_loss
    assert "AttributeError" not in out


# ----------------------------------------------------------------- adamw_param_regex (item 10)


@pytest.mark.unit
@pytest.mark.parametrize("regex", ["", ".*", "weight"])
def test_a_regex_that_leaves_muon_no_matrix_is_refused_at_build_time(regex):
    with pytest.raises(ValueError, match=r"routes all \d+ trainable tensors to AdamW and none to Muon"):
        build([tiny_llama()], "--optimizer.adamw_param_regex", regex)


@pytest.mark.unit
def test_a_regex_that_routes_the_embedding_and_head_to_muon_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        build([tiny_llama()], "--optimizer.adamw_param_regex", "(?!)")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("['tok_embeddings.weight', 'output.weight'] to Muon" in w for w in warnings), warnings


@pytest.mark.unit
def test_the_default_regex_builds_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        build([tiny_llama()])
    assert not [r for r in caplog.records if "to Muon" in r.getMessage()]


@pytest.mark.unit
def test_a_pipeline_stage_with_only_norms_and_the_head_is_not_refused():
    only_head = torch.nn.Module()
    only_head.norm = torch.nn.RMSNorm(64)
    only_head.output = torch.nn.Linear(64, 128, bias=False)
    container = build([only_head])
    assert [g["use_muon"] for g in next(iter(container)).param_groups] == [False]
