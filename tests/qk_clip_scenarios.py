"""Worker functions for the multi-rank QK-clip tests (run by tests/multiprocess.py).

Two attentions on a 16-wide model: multi-head (4 heads of 4) and grouped-query
(4 query heads over 2 key heads), with weights large enough that most heads' logits
exceed the threshold while one head per attention stays under it. Each step, every
rank reports the logits of its share of the global batch (and, under tensor
parallelism, of its heads only), then DMuon steps and clips. The oracle is the same
on plain tensors in one process, reporting the whole batch.

Each report is one sample's ``q``/``k`` computed from the full weights, so the set of
logits the MAX reduction sees is bitwise the set the oracle sees, whatever the layout;
what is under test is the reduction and the row scaling on each rank's block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon import AttentionHeads, DMuon
from tests.distributed_scenarios import _device, device_type

DIM, HEAD_DIM, BATCH, SEQ, STEPS = 16, 4, 4, 6, 3
THRESHOLD = 6.0
ATTENTIONS = {"mha": AttentionHeads(4, 4, HEAD_DIM), "gqa": AttentionHeads(4, 2, HEAD_DIM)}
# The head of each attention whose rows are shrunk at the start, so it stays under the threshold.
QUIET_HEAD = 1


def initial_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    weights = {}
    for name, heads in ATTENTIONS.items():
        weights[f"{name}.wq"] = torch.randn(heads.n_heads * HEAD_DIM, DIM, generator=generator)
        weights[f"{name}.wk"] = torch.randn(heads.n_kv_heads * HEAD_DIM, DIM, generator=generator)
        weights[f"{name}.wq"][QUIET_HEAD * HEAD_DIM : (QUIET_HEAD + 1) * HEAD_DIM] *= 0.05
    return {n: w.to(_device()) for n, w in weights.items()}


def _step_data(step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, SEQ, DIM, generator=generator)
    grads = {n: torch.randn(w.shape, generator=generator) for n, w in initial_weights().items()}
    return x.to(_device()), {n: g.to(_device()) for n, g in grads.items()}


def _full(weight: torch.Tensor) -> torch.Tensor:
    return weight.full_tensor() if isinstance(weight, DTensor) else weight.detach()


def report_logits(optimizer: DMuon, weights: dict[str, torch.Tensor], x: torch.Tensor, samples: range,
                  tp_rank: int = 0, tp: int = 1) -> None:
    """Report each sample's logits, for this rank's heads (TP rank ``tp_rank`` of ``tp``)."""
    with torch.enable_grad():  # the tracker counts training forwards only
        for name, heads in ATTENTIONS.items():
            wq, wk = _full(weights[f"{name}.wq"]), _full(weights[f"{name}.wk"])
            local_q, local_kv = heads.n_heads // tp, heads.n_kv_heads // tp
            for b in samples:
                q = (x[b : b + 1] @ wq.T).view(1, SEQ, heads.n_heads, HEAD_DIM).transpose(1, 2)
                k = (x[b : b + 1] @ wk.T).view(1, SEQ, heads.n_kv_heads, HEAD_DIM).transpose(1, 2)
                optimizer.max_logits.observe(
                    name, q[:, tp_rank * local_q : (tp_rank + 1) * local_q],
                    k[:, tp_rank * local_kv : (tp_rank + 1) * local_kv],
                    n_heads=heads.n_heads, head_offset=tp_rank * local_q)


def make_optimizer(weights: dict[str, torch.Tensor], threshold: float | None = THRESHOLD) -> DMuon:
    optimizer = DMuon(list(weights.items()), lr=0.02, weight_decay=0.1, qk_clip_threshold=threshold, telemetry=True)
    for name, heads in ATTENTIONS.items():
        optimizer.clip_attention(name, weights[f"{name}.wq"], weights[f"{name}.wk"], heads)
    return optimizer


def single_process(threshold: float | None = THRESHOLD) -> dict[str, Any]:
    """The oracle: full plain weights, the whole batch reported, one process."""
    weights = {n: nn.Parameter(w) for n, w in initial_weights().items()}
    optimizer = make_optimizer(weights, threshold)
    clipped = []
    for step in range(STEPS):
        x, grads = _step_data(step)
        report_logits(optimizer, weights, x, range(BATCH))
        for n, g in grads.items():
            weights[n].grad = g
        optimizer.step()
        clipped.append(optimizer.telemetry().qk_clipped_heads)
    return {"weights": {n: w.detach() for n, w in weights.items()}, "max_logits": optimizer.last_max_logits(),
            "clipped": clipped}


# layout -> (mesh shape, placements of wq/wk, data-parallel mesh dims, tensor-parallel mesh dim)
LAYOUTS = {
    "fsdp": (None, (Shard(0),), (0,), None),
    "hsdp": ((2, 2), (Replicate(), Shard(0)), (0, 1), None),
    "fsdp_tp": ((2, 2), (_StridedShard(0, split_factor=2), Shard(0)), (0,), 1),
}


def layouts_match_single_process() -> dict[str, dict[str, bool]]:
    """This rank's ``{layout: {check: ok}}`` for each layout this world size has (HSDP
    and FSDP+TP at 4 ranks): its blocks of the clipped weights, the max logits it was
    told, and its telemetry, each against the single process's."""
    world = dist.get_world_size()
    oracle = single_process()
    out = {}
    for layout, (shape, placements, dp_dims, tp_dim) in LAYOUTS.items():
        if shape is not None and world != 4:
            continue
        mesh = init_device_mesh(device_type(), shape or (world,))
        coordinate = mesh.get_coordinate()
        dp_size = 1
        dp_rank = 0
        for d in dp_dims:
            dp_rank = dp_rank * mesh.shape[d] + coordinate[d]
            dp_size *= mesh.shape[d]
        tp = 1 if tp_dim is None else mesh.shape[tp_dim]
        tp_rank = 0 if tp_dim is None else coordinate[tp_dim]

        def shard(t: torch.Tensor) -> DTensor:
            return distribute_tensor(t, mesh, list(placements), src_data_rank=None)

        weights = {n: nn.Parameter(shard(w)) for n, w in initial_weights().items()}
        optimizer = make_optimizer(weights)
        clipped = []
        for step in range(STEPS):
            x, grads = _step_data(step)
            report_logits(optimizer, weights, x, range(dp_rank, BATCH, dp_size), tp_rank, tp)
            for n, g in grads.items():
                weights[n].grad = shard(g)
            optimizer.step()
            clipped.append(optimizer.telemetry().qk_clipped_heads)
        # This rank's block of each weight (under HSDP full_tensor() would be its replica's only).
        checks = {f"weights.{n}": torch.equal(w.to_local(), shard(oracle["weights"][n]).to_local())
                  for n, w in weights.items()}
        checks.update({f"max_logits.{n}": torch.equal(m, oracle["max_logits"][n])
                       for n, m in optimizer.last_max_logits().items()})
        checks["clipped_heads"] = clipped == oracle["clipped"]
        checks["some_heads_clipped_every_step"] = all(c > 0 for c in clipped)
        out[layout] = checks
    return out
