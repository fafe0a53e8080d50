"""Worker functions for the multi-dim mesh tests: HSDP, FSDP + TP, TP under data
parallel, and expert stacks under EP and EP + FSDP, on 4 ranks (a 2 x 2 mesh).

Each DTensor is built from a full tensor by cutting out the block DTensor itself says
the rank holds (``benchmarks.layouts.as_dtensor``: DTensor's
``compute_local_shape_and_global_offset``), so the inputs do not depend on dmuon's
own layout code. The oracle is single-process DMuon on the full
tensors, in the same worker, one thread.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from benchmarks.layouts import as_dtensor
from dmuon import DMuon
from tests.distributed_scenarios import NS_DTYPES, _device, device_type, normuon_states_agree

STEPS = 3
OPTIONS = dict(lr=0.03, momentum=0.9, weight_decay=0.05)

# (name, shape, placements on a 2 x 2 mesh), as TorchTitan lays them out.
MESH_CASES: dict[str, list[tuple[str, tuple[int, ...], tuple[Placement, ...]]]] = {
    # data_parallel_replicate_degree 2 x data_parallel_shard_degree 2
    "hsdp": [
        ("hsdp.rows", (10, 6), (Replicate(), Shard(0))),
        ("hsdp.tall", (16, 5), (Replicate(), Shard(0))),  # rows of 5: int8 keeps them (narrower: bf16)
        ("hsdp.empty_shard", (1, 5), (Replicate(), Shard(0))),
    ],
    # data_parallel_shard_degree 2 x tensor_parallel_degree 2 (colwise wq: FSDP over TP rows;
    # rowwise wo: FSDP rows, TP columns)
    "fsdp_tp": [
        ("fsdp_tp.colwise", (9, 7), (_StridedShard(0, split_factor=2), Shard(0))),
        ("fsdp_tp.rowwise", (6, 10), (Shard(0), Shard(1))),
    ],
    # data_parallel_replicate_degree 2 x tensor_parallel_degree 2: TP's Shard(1) weights
    "tp": [
        ("tp.rowwise", (6, 10), (Replicate(), Shard(1))),
        ("tp.colwise", (10, 6), (Replicate(), Shard(0))),
    ],
    # experts [E, A, B] on (efsdp, ep): EP cuts dim 0; FSDP cuts dim 0 again, or dim 1 when
    # efsdp * ep > E (TorchTitan's llama4 apply_fsdp)
    "ep_fsdp": [
        ("ep_fsdp.experts_whole", (8, 6, 5), (_StridedShard(0, split_factor=2), Shard(0))),
        ("ep_fsdp.experts_rows", (2, 6, 5), (Shard(1), Shard(0))),
        ("ep.experts_replicated", (4, 6, 5), (Replicate(), Shard(0))),
    ],
}


def _tensors(seed: int, cases) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(_device()) for name, shape, _ in cases}


def mesh_exactness(split_replicas: bool | None, max_batch_numel: int = 1 << 27, ns_dtype: str = "auto",
                   options: dict[str, Any] = OPTIONS) -> dict[str, Any]:
    """Every MESH_CASES parameter in one DMuon (group ``options``) on a 2 x 2 mesh vs the oracle."""
    mesh = init_device_mesh(device_type(), (2, 2))
    cases = [case for group in MESH_CASES.values() for case in group]
    placements = {name: p for name, _, p in cases}
    params = {n: nn.Parameter(as_dtensor(t, mesh, placements[n])) for n, t in _tensors(0, cases).items()}
    oracle = {n: nn.Parameter(t) for n, t in _tensors(0, cases).items()}
    optimizer = DMuon([{"params": list(params.items()), "use_muon": True}], **options, ns_dtype=ns_dtype,
                      split_replicas=split_replicas, max_batch_numel=max_batch_numel)
    reference = DMuon([{"params": list(oracle.items()), "use_muon": True}], **options, ns_dtype=ns_dtype)
    for step in range(STEPS):
        for name, grad in _tensors(100 + step, cases).items():
            params[name].grad = as_dtensor(grad, mesh, placements[name])
            oracle[name].grad = grad
        optimizer.step()
        reference.step()
    (plan,) = optimizer.owner_plans()
    rank = dist.get_rank()
    return {
        "equal": {n: torch.equal(p.full_tensor(), oracle[n].detach()) for n, p in params.items()},
        "moments": normuon_states_agree({n: optimizer.state[p] for n, p in params.items()},
                                        {n: reference.state[p] for n, p in oracle.items()}),
        "paths": optimizer.comm_paths(),
        "bytes": optimizer.comm_stats.bytes_sent,
        "planned_bytes": STEPS * plan.bytes_sent(rank),
        "ns_flops": optimizer.comm_stats.ns_flops,
        "planned_ns_flops": STEPS * plan.ns_flops(rank),
        "total_ns_flops": STEPS * sum(u.cost for u in {(u.param, u.dim0): u for u in plan.units}.values()),
    }


# NorMuon (with a beta2 of its own) and cautious weight decay on top of OPTIONS.
VARIANT_OPTIONS = {**OPTIONS, "normuon": True, "normuon_beta2": 0.9, "cautious_weight_decay": True}


def mesh_variants_exactness(ns_dtype: str = "auto") -> dict[str, dict[str, Any]]:
    """:func:`mesh_exactness` with VARIANT_OPTIONS, Newton-Schulz split across replicas
    and not, in one launch: ``{"split": figures, "apart": figures}``."""
    return {setting: mesh_exactness(split, ns_dtype=ns_dtype, options=VARIANT_OPTIONS)
            for setting, split in (("split", True), ("apart", False))}


def two_stages_on_their_own_ranks() -> dict[str, Any]:
    """Pipeline stages: ranks 0-1 and ranks 2-3 each run their own DMuon over their own
    2-D mesh (a group of only their ranks), like two PP stages under HSDP."""
    rank = dist.get_rank()
    root = init_device_mesh(device_type(), (2, 1, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    mesh = root["dp_replicate", "dp_shard"]
    stage_cases = [("w", (10, 6) if rank < 2 else (7, 9), (Replicate(), Shard(0)))]
    full = _tensors(rank // 2, stage_cases)["w"]
    param = nn.Parameter(as_dtensor(full, mesh, (Replicate(), Shard(0))))
    oracle = nn.Parameter(full.clone())
    optimizer = DMuon([{"params": [("w", param)], "use_muon": True}], **OPTIONS)
    reference = DMuon([{"params": [("w", oracle)], "use_muon": True}], **OPTIONS)
    local_groups = []  # groups made by their members only: a hang under eager NCCL
    real_new_group = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_local_synchronization"):
            local_groups.append(args)
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group
    try:
        for step in range(STEPS):
            grad = _tensors(10 + step + rank // 2, stage_cases)["w"]
            param.grad = as_dtensor(grad, mesh, (Replicate(), Shard(0)))
            oracle.grad = grad
            optimizer.step()
            reference.step()
    finally:
        dist.new_group = real_new_group
    return {"equal": torch.equal(param.full_tensor(), oracle.detach()), "paths": optimizer.comm_paths(),
            "local_groups": len(local_groups)}


def titan_llama3_exactness(dp_replicate: int, dp_shard: int, tp: int) -> dict[str, Any]:
    """A small llama3 parallelized by TorchTitan's own ``parallelize_llama`` (its meshes,
    its ``_StridedShard``), every 2-D hidden weight on Muon, vs the oracle."""
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama
    from torchtitan.models.llama3.model.model import Transformer

    from torchtitan_ext.titan02 import cpu_compat

    cpu_compat.apply()
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, etp=1,
                        world_size=dist.get_world_size())
    dims.build_mesh()
    job = JobConfig()
    job.training.seq_len = 16
    job.training.mixed_precision_param = "float32"
    args = TransformerModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    with torch.device(_device()):
        model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    full = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 2 and "layers" in n}
    parallelize_llama(model, dims, job)
    params = {n: p for n, p in model.named_parameters() if n in full}
    start = {n: p.to_local().clone() for n, p in params.items()}
    equal = {}
    for ns_dtype in NS_DTYPES:  # each from the same start
        with torch.no_grad():
            for name, param in params.items():
                param.to_local().copy_(start[name])
        oracle = {n: nn.Parameter(t.clone()) for n, t in full.items()}
        optimizer = DMuon([{"params": list(params.items()), "use_muon": True}], **OPTIONS, ns_dtype=ns_dtype)
        reference = DMuon([{"params": list(oracle.items()), "use_muon": True}], **OPTIONS, ns_dtype=ns_dtype)
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 + step)
            for name, param in params.items():
                grad = torch.randn(full[name].shape, generator=generator).to(_device())
                param.grad = as_dtensor(grad, param.device_mesh, tuple(param.placements))
                oracle[name].grad = grad
            optimizer.step()
            reference.step()
        equal[ns_dtype] = {n: torch.equal(p.full_tensor(), oracle[n].detach()) for n, p in params.items()}
    return {
        "equal": equal,
        "placements": {n: str(tuple(p.placements)) for n, p in params.items()},
        "paths": optimizer.comm_paths(),
    }


def reference_transport() -> dict[str, bool]:
    """The reference way on a 2 x 2 mesh: each rank gets its part of the whole result."""
    from dmuon.exchange.reference import orthogonalize_gathered
    from dmuon.numerics.newton_schulz import orthogonalize

    mesh = init_device_mesh(device_type(), (2, 2))
    out = {}
    for name, shape, placements in [case for group in MESH_CASES.values() for case in group]:
        if len(shape) != 2:
            continue
        full = _tensors(7, [(name, shape, placements)])[name].bfloat16()
        param = as_dtensor(full, mesh, placements)
        mine = orthogonalize_gathered(param.to_local(), param, orthogonalize)
        out[name] = torch.equal(mine, as_dtensor(orthogonalize(full), mesh, placements).to_local())
    return out
