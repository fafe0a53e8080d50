"""dmuon: a distributed Muon optimizer native to PyTorch DTensor/FSDP2.

``DMuon`` orthogonalizes each sharded matrix once, on one owner rank, and keeps
everything elementwise on the local shards. See README.md and docs/architecture.md.

The public surface is three modules (docs/development.md, "The public surface"; a test
keeps torchtitan_ext/ and benchmarks/ to them): this package's ``__all__`` (the optimizer,
its captured step, QK-clip's pieces, the figures it reports), ``dmuon.options`` (the option
table and its checks, for front ends such as TorchTitan's) and ``dmuon.tools`` (the
tools and the internals the benchmarks measure). The package sits above ``dmuon.capture``.
"""

from dmuon.attention.max_logits import MaxLogitTracker
from dmuon.attention.qk_clip import FUSED_GROUPED, SEPARATE, AttentionHeads, MaskMod
from dmuon.exchange.comm import CommStats, mesh_device
from dmuon.numerics.newton_schulz import (DEFAULT_NS_COEFFICIENTS_NAME, KELLER_COEFFICIENTS, NS_COEFFICIENT_SETS,
                                          orthogonalize)
from dmuon.numerics.update_rules import ADJUST_LR_CHOICES, shape_scale
from dmuon.optimizer import DMuon
from dmuon.options.param_groups import DEFAULT_ADAMW_NAME_PATTERN, default_use_muon
from dmuon.step.telemetry import StepFigures
from dmuon.capture.cuda_graphs import CapturedStep  # after DMuon: the captured step wraps one
from dmuon.capture.replay_guard import ReplayGuard

__all__ = [
    "ADJUST_LR_CHOICES", "AttentionHeads", "CapturedStep", "CommStats", "DEFAULT_ADAMW_NAME_PATTERN",
    "DEFAULT_NS_COEFFICIENTS_NAME", "DMuon", "FUSED_GROUPED", "KELLER_COEFFICIENTS", "MaskMod", "MaxLogitTracker",
    "NS_COEFFICIENT_SETS", "ReplayGuard", "SEPARATE", "StepFigures", "default_use_muon", "mesh_device",
    "orthogonalize", "shape_scale",
]
__version__ = "0.1.0"
