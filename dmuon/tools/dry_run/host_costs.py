"""What a step costs the hosts, which a fake process group would otherwise hide: the
process groups DMuon makes, the Python heap its plan keeps, and (with the recorder) the
collectives on CPU tensors and whether every step dispatches the same program.

Under the fake group every collective is free and every group is made at once, so these
are counted, not timed (``dmuon.tools.dry_run.fake_cuda.fake_cuda_rank(nccl_alone=True)`` makes the
default group take CUDA tensors only, as NCCL alone, TorchTitan's GPU default).
"""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

from dmuon.optimizer import DMuon
from dmuon.options.param_groups import muon_groups


@dataclass
class GroupCount:
    """Process groups made while it was counting."""

    made: int = 0


@contextlib.contextmanager
def counting_groups() -> Iterator[GroupCount]:
    """Count ``dist.new_group`` calls while inside."""
    count = GroupCount()
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - dist.new_group's signature
        count.made += 1
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield count
    finally:
        dist.new_group = real_new_group


def plan_host_bytes(optimizer: DMuon) -> int:
    """The Python heap (``tracemalloc``) the optimizer's plan keeps: its paths, its owner
    plan with this rank's blocks, and every batch's buffer layout, made here as the first
    step would make them (the step then finds them made)."""
    with retained_heap() as heap:
        optimizer.phases.fast_path.plan(muon_groups(optimizer.param_groups), optimizer.param_name)
        run = optimizer.phases.fast_path.owner_run  # the plan and its batch layouts
        if run is not None:
            for batch in run.plan.batches:
                run.layout(batch)
    return heap[0]


@contextlib.contextmanager
def retained_heap() -> Iterator[list[int]]:
    """The Python heap (``tracemalloc``) retained from entry to exit, after a collection."""
    result = [0]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    try:
        yield result
    finally:
        gc.collect()
        result[0] = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
