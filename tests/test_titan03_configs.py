"""The TorchTitan 0.3 config functions (``torchtitan_ext.titan03.configs``) build valid
configs through TorchTitan's own ``ConfigManager`` (the path ``-m torchtitan.train
--module ... --config ...`` takes), and building them changes nothing in the process.
Skipped without TorchTitan 0.3."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

from tests.titan03_support import require_titan03  # noqa: E402

require_titan03()

import torch  # noqa: E402
import torchtitan.tools.utils as titan_utils  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from torchtitan_ext.titan03 import configs, cpu_compat  # noqa: E402
from torchtitan_ext.titan03.cpu_attention import CpuBlockCausalAttention  # noqa: E402
from torchtitan_ext.titan03.data import PydocDataLoader, PydocTokenizer  # noqa: E402
from torchtitan_ext.titan03.optimizer import DMuonOptimizersContainer  # noqa: E402

MODULE = "torchtitan_ext.titan03.configs"
NO_ACCELERATOR = not torch.accelerator.is_available()


def _parse(config: str, *flags: str) -> Trainer.Config:
    return ConfigManager().parse_args(["--module", MODULE, "--config", config, *flags])


def _inner_attentions(config: Trainer.Config) -> list:
    return [layer.attention.inner_attention for layer in config.model_spec.model.layers]


@pytest.mark.parametrize("name", ["llama3_debug_cpu", "llama3_debug_cpu_adamw"])
def test_the_debug_configs_mirror_the_02_demo(name):
    config = _parse(name)
    assert isinstance(config, Trainer.Config)
    assert (config.training.local_batch_size, config.training.seq_len, config.training.steps) == (2, 256, 200)
    assert config.training.mixed_precision_param == "float32"
    assert isinstance(config.dataloader, PydocDataLoader.Config) and config.dataloader.dataset == "pydoc"
    assert config.validator.enable and config.validator.dataloader.dataset == "pydoc_validation"
    assert isinstance(config.tokenizer, PydocTokenizer.Config)
    assert config.model_spec.flavor == "debugmodel"
    if NO_ACCELERATOR:
        assert all(isinstance(a, CpuBlockCausalAttention.Config) for a in _inner_attentions(config))


def test_the_debug_config_trains_with_dmuon_and_its_twin_with_adamw():
    dmuon = _parse("llama3_debug_cpu").optimizer
    assert isinstance(dmuon, DMuonOptimizersContainer.Config)
    group = dmuon.param_groups[0]
    assert group.optimizer_name == "DMuon"
    assert (group.optimizer_kwargs["lr"], group.optimizer_kwargs["adamw_lr"]) == (0.02, 2e-3)
    adamw = _parse("llama3_debug_cpu_adamw").optimizer.param_groups[0]
    assert adamw.optimizer_name == "AdamW" and adamw.optimizer_kwargs["lr"] == 2e-3


def test_command_line_flags_override_the_config_function():
    config = _parse("llama3_debug_cpu", "--training.steps", "7", "--optimizer.param_groups.0.optimizer_kwargs.ns_steps", "6")
    assert config.training.steps == 7
    assert config.optimizer.param_groups[0].optimizer_kwargs["ns_steps"] == 6


def test_the_8b_config_builds_with_dmuon_and_torchtitans_own_attention():
    config = _parse("llama3_8b_dmuon")
    assert config.model_spec.flavor == "8B"
    group = config.optimizer.param_groups[0]
    assert isinstance(config.optimizer, DMuonOptimizersContainer.Config) and group.optimizer_name == "DMuon"
    assert (group.optimizer_kwargs["lr"], group.optimizer_kwargs["adjust_lr"]) == (3e-4, "match_rms_adamw")
    assert (config.training.seq_len, config.training.mixed_precision_param) == (8192, "bfloat16")
    assert not any(isinstance(a, CpuBlockCausalAttention.Config) for a in _inner_attentions(config))


def test_building_configs_installs_nothing():
    device_type = titan_utils.device_type
    for name in configs.__all__:
        if name.startswith("llama3"):
            try:
                getattr(configs, name)()
            except ValueError as error:  # a float8 recipe: TorchTitan refuses float8 without an SM89+ GPU
                assert name.endswith("_float8") and "Float8Linear" in str(error), (name, error)
    assert not cpu_compat.installed()
    assert titan_utils.device_type == device_type
