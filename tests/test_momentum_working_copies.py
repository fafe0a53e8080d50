"""A momentum kept in bf16 or int8 is read into the parameter's dtype a chunk at a time, and
nothing of a read outlives it (issue 59, item 2): the step's peak is the parameter-dtype
momentum's, and at rest only the store is left. Each test watches the working copies the
step makes (weak references to what ``read_momenta`` returns) on one process; the bits of
the chunked step are the exactness tests' (tests/test_momentum_dtype_ranks.py), its peak
at scale the dry run's (tests/test_dry_run.py)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dmuon.state.kept_state as kept_state
from benchmarks import momentum_memory
from dmuon import DMuon
from tests.multiprocess import run_on_ranks


SHAPES = [(64, 128), (32, 256), (48, 128), (16, 384)]


class WorkingCopies:
    """Every working copy ``read_momenta`` hands out, and how many elements of earlier reads
    were still alive at each new read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refs: list[weakref.ref] = []
        self.alive_at_read: list[int] = []
        self.largest = 0  # elements of the largest read
        original = kept_state.read_momenta

        def spied(values, scales, dtypes):
            self.alive_at_read.append(self.alive())
            copies = original(values, scales, dtypes)
            made = [t for t, v in zip(copies.working, values) if t is not v]
            self.refs += [weakref.ref(t) for t in made]
            self.largest = max(self.largest, sum(t.numel() for t in made))
            return copies

        monkeypatch.setattr(kept_state, "read_momenta", spied)

    def alive(self) -> int:
        return sum(t.numel() for ref in self.refs if (t := ref()) is not None)


def _grads(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _step_twice(params: list[torch.nn.Parameter], optimizer: DMuon, place=lambda t: t) -> None:
    for step in range(2):
        for param, grad in zip(params, _grads(100 + step)):
            param.grad = place(grad)
        optimizer.step()


def fast_path_reads(momentum_dtype: str) -> dict:
    """On each of 2 ranks (``Shard(0)``, the owner exchange): the elements of earlier working
    copies alive at each read, with pack chunks of two matrices' blocks at most."""
    import dmuon.exchange.packing
    import dmuon.step.fast_path
    import dmuon.plan.pack_layout

    mesh = init_device_mesh("cpu", (2,))
    chunk = 2 * 8192 // 2  # two matrices' blocks of 4,096 elements a rank
    for module in (dmuon.plan.pack_layout, dmuon.step.fast_path):
        module.PACK_CHUNK_NUMEL = chunk
    with pytest.MonkeyPatch.context() as monkeypatch:
        copies = WorkingCopies(monkeypatch)
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in _grads(0)]
        optimizer = DMuon([{"params": params, "use_muon": True}], lr=0.02, momentum_dtype=momentum_dtype,
                          split_replicas=False)
        _step_twice(params, optimizer, lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        return {"fast": optimizer.phases.fast_path.owner_run is not None, "alive_at_read": copies.alive_at_read,
                "alive_after": copies.alive(), "largest_read": copies.largest}


@pytest.mark.multirank
@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "int8"])
def test_the_fast_path_reads_a_pack_chunk_at_a_time_and_keeps_no_working_copy(momentum_dtype):
    ranks = run_on_ranks(fast_path_reads, 2, momentum_dtype)
    for rank in ranks:
        assert rank["fast"]
        assert len(rank["alive_at_read"]) >= 2 * 2  # at least two chunks a step
        assert rank["alive_at_read"] == [0] * len(rank["alive_at_read"])
        assert 0 < rank["largest_read"] <= 8192  # one pack chunk's blocks
        assert rank["alive_after"] == 0  # at rest: the stores only


@pytest.mark.unit
@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "int8"])
def test_plain_tensors_momenta_are_read_a_chunk_at_a_time_and_none_is_kept(one_thread, momentum_dtype,
                                                                           monkeypatch):
    # Chunks of the first two matrices (8,192 elements each), then of the last two (6,144 each).
    monkeypatch.setattr(kept_state, "READ_CHUNK_NUMEL", 2 * 8192)
    params = [torch.nn.Parameter(t) for t in _grads(0)]
    optimizer = DMuon([{"params": params, "use_muon": True}], lr=0.02, momentum_dtype=momentum_dtype)
    copies = WorkingCopies(monkeypatch)
    _step_twice(params, optimizer)
    assert len(copies.alive_at_read) == 2 * 2  # two chunks a step
    assert copies.alive_at_read == [0] * 4
    assert copies.alive() == 0


@pytest.mark.unit
def test_momenta_held_in_the_parameters_dtype_are_updated_in_one_read(one_thread, monkeypatch):
    monkeypatch.setattr(kept_state, "READ_CHUNK_NUMEL", 1)  # would split any chunked read
    params = [torch.nn.Parameter(t) for t in _grads(0)]
    optimizer = DMuon([{"params": params, "use_muon": True}], lr=0.02)
    copies = WorkingCopies(monkeypatch)
    _step_twice(params, optimizer)
    assert len(copies.alive_at_read) == 2  # one read a step: the momenta are their own working tensors
    assert copies.refs == []


@pytest.mark.unit
def test_read_chunks_take_an_empty_shard_first_and_a_shard_larger_than_a_chunk_alone(monkeypatch):
    monkeypatch.setattr(kept_state, "READ_CHUNK_NUMEL", 100)
    kept = {"momentum_buffer": torch.zeros(1, dtype=torch.bfloat16)}  # held in another dtype than fp32
    likes = [torch.zeros(0, 128), torch.zeros(10, 6), torch.zeros(30, 5), torch.zeros(4, 6)]
    assert kept_state.read_chunks([kept] * 4, likes) == [[0, 1], [2], [3]]


# The matrices (issue 60, item 1): under FSDP at P = 2 the int8 momentum kept a full
# fp32 copy alive between steps (1.62 MiB of fp32 beside a 0.42 MiB state).
AT_REST_SHAPES = [(512, 1024), (256, 1024), (64, 1000)]


@pytest.mark.multirank
@pytest.mark.parametrize("momentum_dtype, most", [("int8", 1.05), ("bfloat16", 2.01), (None, 4.01)])
def test_the_bytes_alive_at_rest_are_the_kept_states_measured_from_live_tensors(momentum_dtype, most):
    # At rest (between steps, grads dropped) nothing but the state and the step's pending
    # status sums (a few bytes a parameter) outlives a step (benchmarks.momentum_memory counts
    # the storages of every live tensor).
    for rank in run_on_ranks(momentum_memory.measure, 2, AT_REST_SHAPES, momentum_dtype):
        assert rank["state"] <= rank["at_rest"] <= most, rank
        assert rank["at_rest"] - rank["state"] < 0.001, rank
