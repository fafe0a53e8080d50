"""Lay a dry-run model out as TorchTitan does, with PyTorch's own APIs (so the
placements DMuon sees are the real ones):

- ``fsdp``: ``fully_shard`` of every block and the root on a 1-D mesh: ``Shard(0)``;
- ``hsdp:RxS``: ``fully_shard`` on a ``(dp_replicate, dp_shard)`` mesh of R replicas of
  S shards: ``(Replicate(), Shard(0))`` (``hsdp`` alone: 2 replicas);
- ``fsdp_tp:T``: TorchTitan's tensor-parallel plan on a ``tp`` mesh of T ranks
  (``ColwiseParallel``: wq wk wv w1 w3 and the output head; ``RowwiseParallel``: wo w2
  and the embeddings, sharded over the vocabulary), then ``fully_shard`` on ``dp_shard``
  (``fsdp_tp``: T = 2); norms replicated over ``tp``;
- ``tp``: the same tensor-parallel plan over every rank; norms stay replicated;
- ``ep``: MoE presets only: each expert stack ``distribute_tensor(..., [Shard(0)])`` over
  every rank (experts split among ranks), every other parameter ``fully_shard``.

With ``offload`` (``--cpu-offload``), every ``fully_shard`` takes FSDP2's
``CPUOffloadPolicy(pin_memory=False)`` (fake tensors cannot be pinned; a real run pins):
the sharded parameters' local tensors are host tensors on the CUDA mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon.tools.dry_run.fake_cuda import DryRunError
from dmuon.tools.dry_run.models import Transformer

LAYOUTS = ("fsdp", "hsdp", "fsdp_tp", "tp", "ep")
# The layouts whose FSDP2 holds every Muon matrix, so its offload policy moves them all to
# the host (``tp`` runs no fully_shard; ``ep`` keeps the experts out of it).
OFFLOAD_LAYOUTS = ("fsdp", "hsdp", "fsdp_tp")
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")
DEVICE_TYPE = "cuda"


@dataclass(frozen=True)
class LayoutSpec:
    """A layout name with its mesh shape."""

    name: str
    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...]

    def __str__(self) -> str:
        if self.name == "hsdp":
            return f"hsdp:{self.mesh_shape[0]}x{self.mesh_shape[1]}"
        if self.name == "fsdp_tp":
            return f"fsdp_tp:{self.mesh_shape[1]}"
        return self.name


def parse_layout(text: str, world_size: int) -> LayoutSpec:
    """``fsdp``, ``hsdp[:RxS]``, ``fsdp_tp[:T]``, ``tp`` or ``ep`` at ``world_size`` ranks."""
    name, _, size = text.partition(":")
    if name not in LAYOUTS:
        raise DryRunError(f"unknown layout {text!r}; choose from fsdp, hsdp[:RxS], fsdp_tp[:T], tp, ep")
    if world_size < 1:
        raise DryRunError(f"--world-size must be at least 1, got {world_size}")
    if name == "hsdp":
        replicas, shards = _ints(size, "x", text) if size else (2, world_size // 2)
        if replicas * shards != world_size or replicas < 1 or shards < 1:
            raise DryRunError(f"--layout {text}: R x S must equal the world size {world_size}, e.g. "
                              f"hsdp:2x{world_size // 2}" if world_size % 2 == 0 else
                              f"--layout {text} cannot split an odd world size {world_size} into 2 replicas; "
                              "pass hsdp:RxS")
        return LayoutSpec(name, (replicas, shards), ("dp_replicate", "dp_shard"))
    if name == "fsdp_tp":
        (tp,) = _ints(size, "x", text) if size else (2,)
        if tp < 1 or world_size % tp:
            raise DryRunError(f"--layout {text}: the TP degree {tp} must divide the world size {world_size}")
        return LayoutSpec(name, (world_size // tp, tp), ("dp_shard", "tp"))
    if size:
        raise DryRunError(f"--layout {name} takes no size, got {text!r}")
    return LayoutSpec(name, (world_size,), ("tp",) if name == "tp" else ("dp_shard",))


def _ints(text: str, sep: str, whole: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(sep))
    except ValueError:
        raise DryRunError(f"--layout {whole}: {text!r} is not a size (write e.g. hsdp:2x32 or fsdp_tp:4)") from None


def make_mesh(spec: LayoutSpec) -> DeviceMesh:
    return init_device_mesh(DEVICE_TYPE, spec.mesh_shape, mesh_dim_names=spec.dim_names)


def lay_out(model: Transformer, spec: LayoutSpec, mesh: DeviceMesh, offload: bool = False) -> None:
    """Shard ``model`` in place as ``spec`` says (its FSDP2 offloading to the host with ``offload``)."""
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    if spec.name in ("fsdp_tp", "tp"):
        plan = {name: ColwiseParallel() for name in COLWISE} | {name: RowwiseParallel() for name in ROWWISE}
        tp_mesh = mesh["tp"]
        for block in model.layers:
            parallelize_module(block, tp_mesh, {k: v for k, v in plan.items() if _has(block, k)})
        parallelize_module(model, tp_mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                            "output": ColwiseParallel()})
        if spec.name == "tp":
            return
        mesh = mesh["dp_shard"]
    if spec.name == "ep":
        for block in model.layers:
            for name, param in _experts(block).items():
                setattr(block.moe.experts, name, nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)])))
        ignored = {p for block in model.layers for p in _experts(block).values()}
        for block in model.layers:
            fully_shard(block, mesh=mesh, ignored_params=ignored, **policy)
        fully_shard(model, mesh=mesh, ignored_params=ignored, **policy)
        return
    for block in model.layers:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)


def _experts(block: nn.Module) -> dict[str, nn.Parameter]:
    moe = getattr(block, "moe", None)
    return {} if moe is None else dict(moe.experts.named_parameters())


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
