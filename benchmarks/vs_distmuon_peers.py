"""The optimizers ``python -m benchmarks.vs_distmuon --time`` sets side by side, each
built with the same hyperparameters, and the CPU shims TorchTitan's DistMuon needs.

- ``dmuon``: DMuon on its owner exchange, Newton-Schulz in bf16 (``torch.optim.Muon``'s
  dtype, so that the two can agree bit for bit);
- ``distmuon``: TorchTitan 0.3's DistMuon configured as its own Kimi recipe configures
  it for dense matrices (``models/kimi_k2_7/config_registry.py: _dist_muon_optimizer``):
  ``ComputeLayout({"dp_shard": Owned()})`` per FQN (an owner per matrix) and a
  ``BucketConfig`` per transformer block, its patterns that block's FQNs;
- ``dion``: Microsoft Dion's ``Muon`` (GitHub only: a user's checkout on the path);
  Newton-Schulz at Keller's coefficients (:func:`keller_newton_schulz`, its
  ``newton_schulz_func``); its own conventions, which no option turns into
  ``torch.optim.Muon``'s: momentum ``M = mu M + G`` (not an average), lr scaled by
  ``sqrt(rows / cols)``;
- ``dtensor_muon``: the ``dtensor-muon`` package's ``Muon`` (per parameter, on DTensors),
  plain weight decay and Newton-Schulz at Keller's coefficients; its conventions:
  momentum ``M = mu M + G``, decay inside the scaled step (``p -= lr' (U + wd p)``).

An optimizer whose package does not import is *absent*, and the benchmark says so
instead of failing; one that imports but cannot step a CPU mesh (dtensor-muon) is
reported as such (:func:`skip_reason`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence

import torch

from dmuon import DMuon

# The hyperparameters every optimizer gets. Those of torch.optim.Muon's that the others
# spell differently are named for each below.
LR = 0.02
WEIGHT_DECAY = 0.1
MOMENTUM = 0.95
NESTEROV = True
NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # Keller Jordan's, torch.optim.Muon's default
NS_EPS = 1e-7
ADJUST_LR = "original"  # lr * sqrt(max(1, rows / cols)), torch.optim.Muon's default
NS_DTYPE = "bfloat16"  # what torch.optim.Muon and DistMuon compute Newton-Schulz in
HYPERPARAMETERS = {"lr": LR, "weight_decay": WEIGHT_DECAY, "momentum": MOMENTUM, "nesterov": NESTEROV,
                   "ns_steps": NS_STEPS, "ns_coefficients": list(NS_COEFFICIENTS), "eps": NS_EPS,
                   "adjust_lr": ADJUST_LR, "ns_dtype": NS_DTYPE}

# The module each optimizer needs, and where a user gets it.
REQUIRES = {"dmuon": ("dmuon", "this project"),
            "distmuon": ("torchtitan.distributed.flex_shard", "torchtitan==0.3.0"),
            "dion": ("dion", "a checkout of github.com/microsoft/dion on PYTHONPATH"),
            "dtensor_muon": ("dtensor_muon", "pip install dtensor-muon")}
OPTIMIZERS = tuple(REQUIRES)
# The mesh axis FSDP2 shards on, as TorchTitan names it (ParallelDims' "dp_shard").
DP_SHARD = "dp_shard"
ATTENTION = ("wq", "wk", "wv", "wo")


# Those that import but cannot step a CPU mesh as they ship (only DistMuon is shimmed here).
NOT_ON_CPU = {"dtensor_muon": "its Newton-Schulz runs Triton kernels on CUDA tensors (dtensor_muon/kernels/gram.py "
                              "asserts is_cuda; MuonForeach moves each batch to cuda)"}


def skip_reason(name: str) -> str | None:
    """None if ``name`` runs here; otherwise why not: its package does not import
    (absent, and where to get it), or it cannot run on a CPU mesh."""
    module, source = REQUIRES[name]
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"absent: {error} (from {source})"
    if name in NOT_ON_CPU:
        return f"does not run on CPU: {NOT_ON_CPU[name]}"
    return None


def titan_fqn(name: str) -> str:
    """``benchmarks.bench_workload``'s ``"3.wq.weight"`` as TorchTitan's llama3 names it,
    ``"layers.3.attention.wq.weight"``: DistMuon sorts and buckets by these names."""
    block, matrix, leaf = name.split(".")
    part = "attention" if matrix in ATTENTION else "feed_forward"
    return f"layers.{block}.{part}.{matrix}.{leaf}"


def torch_muon(params: Sequence[torch.Tensor]) -> torch.optim.Muon:
    """The reference: ``torch.optim.Muon`` (on full, plain weights)."""
    return torch.optim.Muon(params, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=NESTEROV,
                            ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, ns_steps=NS_STEPS, adjust_lr_fn=ADJUST_LR)


def build_dmuon(params: Sequence[torch.Tensor], fqns: Sequence[str]) -> torch.optim.Optimizer:
    return DMuon(list(params), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=NESTEROV,
                 ns_steps=NS_STEPS, ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, adjust_lr=ADJUST_LR,
                 ns_dtype=NS_DTYPE, comm="all_to_all")


def distmuon_bucket_patterns(fqns: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, patterns) of one bucket per transformer block, in block order."""
    blocks: dict[str, list[str]] = {}
    for fqn in fqns:
        blocks.setdefault(fqn.split(".")[1], []).append(fqn)
    return [(f"layers.{block}", tuple(names)) for block, names in sorted(blocks.items(), key=lambda b: int(b[0]))]


def build_distmuon(params: Sequence[torch.Tensor], fqns: Sequence[str]) -> torch.optim.Optimizer:
    from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned, build_dist_muon

    owned = ComputeLayout(shardings_by_mesh_axis={DP_SHARD: Owned()})
    buckets = [BucketConfig(name=name, patterns=patterns) for name, patterns in distmuon_bucket_patterns(fqns)]
    with distmuon_cpu_shims():
        return build_dist_muon([{"params": list(params), "param_names": list(fqns)}],
                               compute_sharding_by_fqn={fqn: owned for fqn in fqns}, bucket_configs=buckets,
                               lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=NESTEROV,
                               ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, ns_steps=NS_STEPS,
                               adjust_lr_fn=ADJUST_LR)


def keller_newton_schulz(x: torch.Tensor, epsilon: float = NS_EPS) -> torch.Tensor:
    """``NS_STEPS`` iterations at ``NS_COEFFICIENTS`` in bf16 on a matrix or a batch of
    them (Dion's ``newton_schulz_func`` signature): ``torch.optim.Muon``'s iteration,
    since Dion's own non-Polar-Express one uses other coefficients, one triple a step."""
    a, b, c = NS_COEFFICIENTS
    y = x.to(torch.bfloat16)
    tall = y.size(-2) > y.size(-1)
    y = y.mT if tall else y
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=epsilon)
    for _ in range(NS_STEPS):
        gram = y @ y.mT
        y = a * y + (b * gram + c * (gram @ gram)) @ y
    return y.mT if tall else y


def build_dion(params: Sequence[torch.Tensor], fqns: Sequence[str]) -> torch.optim.Optimizer:
    from dion import Muon

    mesh = params[0].device_mesh
    return Muon(list(params), distributed_mesh=mesh, lr=LR, mu=MOMENTUM, weight_decay=WEIGHT_DECAY,
                nesterov=NESTEROV, epsilon=NS_EPS, adjust_lr="spectral_norm", newton_schulz_func=keller_newton_schulz)


def build_dtensor_muon(params: Sequence[torch.Tensor], fqns: Sequence[str]) -> torch.optim.Optimizer:
    from dtensor_muon import Muon

    # Plain decay (its default is cautious), Keller's Newton-Schulz (its default is Polar
    # Express); its lr scaling is torch.optim.Muon's "original" already.
    return Muon(list(params), lr=LR, wd=WEIGHT_DECAY, use_cautious_wd=False, momentum=MOMENTUM, nesterov=NESTEROV,
                ns_steps=NS_STEPS, orthogonalization_strategy="newton_schulz")


BUILDERS: dict[str, Callable[[Sequence[torch.Tensor], Sequence[str]], torch.optim.Optimizer]] = {
    "dmuon": build_dmuon, "distmuon": build_distmuon, "dion": build_dion, "dtensor_muon": build_dtensor_muon}


# ---------------------------------------------------------------- DistMuon's CPU shims
# Only while DistMuon is built: both CUDA-only spots are reached from its constructor
# alone (the storage check, and the transfer stream made once by reserve_buffers and
# kept). Its steps then run unchanged: torch.cpu's current_stream, stream(), Event and
# wait_stream exist as no-ops, and its all_to_all_single takes gloo's CPU tensors.

class _CpuStream(torch.cpu.Stream):
    """``torch.cpu.Stream`` that takes the ``device=`` argument DistMuon's runtime passes
    (``_CommunicationContext.create``: ``Stream(device=..., priority=0)``): torch.cpu's
    accepts ``priority`` alone and raises on ``device``. A CPU stream is a no-op either way."""

    def __init__(self, device: torch.device | None = None, priority: int = -1) -> None:
        super().__init__(priority)


def _one_local_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """DistMuon's ``_validate_parameter_storage`` without its ``type == "cuda"`` test,
    which refuses CPU shards ("requires one CUDA device per process"); the rest kept:
    DTensor parameters, all on one device, which it returns."""
    from torch.distributed.tensor import DTensor

    devices = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                raise TypeError("DistMuon requires DTensor parameters")
            devices.add(param.to_local().device)
    if len(devices) != 1:
        raise ValueError(f"DistMuon requires one device per process, got {sorted(map(str, devices))}")
    return devices.pop()


@contextlib.contextmanager
def distmuon_cpu_shims() -> Iterator[None]:
    """DistMuon's two CUDA-only spots made CPU-capable, restored on exit."""
    from torchtitan.distributed.flex_shard.dist_muon import DistMuon

    saved = DistMuon._validate_parameter_storage, torch.cpu.Stream
    DistMuon._validate_parameter_storage = _one_local_device
    torch.cpu.Stream = _CpuStream
    try:
        yield
    finally:
        DistMuon._validate_parameter_storage, torch.cpu.Stream = saved
