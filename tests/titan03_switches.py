"""Config functions of the TorchTitan 0.3 switch runs (``tests/test_titan03_switches.py``,
``--module tests.titan03_switches --config NAME``), and the step probe: imported by every
rank when the job reads its config, so with ``DMUON_SWITCH_PROBE=<folder>`` set it arms
``tests/titan_hooks/step_probe.py`` before the Trainer exists.
"""

from __future__ import annotations

import copy

from tests.titan_hooks.step_probe import install_from_env

# More blocks than Dynamo's recompile limit (8): a recompile per block would fail.
DEEP_LAYERS = 12


def _deepened(config):
    """``config`` with its model's blocks repeated up to ``DEEP_LAYERS`` (each its own copy)."""
    layers = config.model_spec.model.layers
    config.model_spec.model.layers = [copy.deepcopy(layers[i % len(layers)]) for i in range(DEEP_LAYERS)]
    return config


def llama3_deep_cpu_qk_clip():
    """The CPU demo with QK-clip (``configs.llama3_debug_cpu_qk_clip``) at 12 blocks."""
    from torchtitan_ext.titan03.configs import llama3_debug_cpu_qk_clip

    return _deepened(llama3_debug_cpu_qk_clip())


def llama3_deep_cpu():
    """The CPU demo (``configs.llama3_debug_cpu``) at 12 blocks, without QK-clip."""
    from torchtitan_ext.titan03.configs import llama3_debug_cpu

    return _deepened(llama3_debug_cpu())



def llama3_debug_cpu_float8():
    """The CPU demo with the 8B float8 recipe's converters (``configs.float8_linears``),
    emulated: float8 matmuls need an SM89+ GPU."""
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry

    from torchtitan_ext.titan03.configs import cpu_ready, DEBUG_FLAVOR, float8_linears, llama3_debug_cpu

    config = llama3_debug_cpu()
    config.model_spec = cpu_ready(model_registry(DEBUG_FLAVOR, converters=float8_linears(config.compile, emulate=True)))
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    return config


install_from_env()
