"""Worker function for the multi-rank telemetry test (run by tests/multiprocess.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests import distributed_scenarios as scenarios


def figures_sharded_and_single() -> dict[str, Any]:
    """The last step's figures of DMuon on FSDP-like ``Shard(0)`` DTensors, next to those
    of single-process DMuon on the full tensors (computed in the worker too)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(t):
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    params = {n: nn.Parameter(shard(t)) for n, t in scenarios._case_tensors(0).items()}
    sharded = scenarios._run(params, lambda step: {n: shard(t) for n, t in scenarios._case_tensors(100 + step).items()},
                             telemetry=True)
    full = {n: nn.Parameter(t) for n, t in scenarios._case_tensors(0).items()}
    single = scenarios._run(full, lambda step: scenarios._case_tensors(100 + step), telemetry=True)
    return {
        "sharded": dataclasses.asdict(sharded.telemetry()),
        "single": dataclasses.asdict(single.telemetry()),
        "bytes_total": sharded.comm_stats.bytes_sent,
        "steps": scenarios.STEPS,
    }
