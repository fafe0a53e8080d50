"""dmuon: a distributed Muon optimizer native to PyTorch DTensor/FSDP2.

``DMuon`` orthogonalizes each sharded matrix once, on one owner rank, and keeps
everything elementwise on the local shards. See README.md and docs/architecture.md.

``python -m dmuon.tools.plan_report`` models the plan at scale from shapes alone. The step
benchmark is not part of this package: it is ``benchmarks.bench`` in the repository,
run from its root (``torchrun --standalone --nproc-per-node 2 -m benchmarks.bench``).
"""

from dmuon.attention.max_logits import MaxLogitTracker
from dmuon.attention.qk_clip import AttentionHeads
from dmuon.exchange.comm import CommStats
from dmuon.numerics.newton_schulz import KELLER_COEFFICIENTS, NS_COEFFICIENT_SETS, orthogonalize
from dmuon.numerics.update_rules import ADJUST_LR_CHOICES, shape_scale
from dmuon.optimizer import DMuon
from dmuon.options.param_groups import DEFAULT_ADAMW_NAME_PATTERN, default_use_muon

__all__ = [
    "ADJUST_LR_CHOICES",
    "AttentionHeads",
    "CommStats",
    "DEFAULT_ADAMW_NAME_PATTERN",
    "DMuon",
    "KELLER_COEFFICIENTS",
    "MaxLogitTracker",
    "NS_COEFFICIENT_SETS",
    "default_use_muon",
    "orthogonalize",
    "shape_scale",
]
__version__ = "0.1.0"
