"""The exactness and robustness scenarios on CUDA with NCCL.

Skipped without a GPU (CI has none; none of these has run on a GPU yet: no session of this
project has had one). With one GPU: the single-process checks; with two
or more: the multi-rank scenarios on NCCL, which, unlike gloo, rejects any buffer that
is not on the GPU. Run them with ``bash scripts/test.sh tests/test_cuda.py`` on a GPU
machine (docs/development.md, "CUDA").
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests import distributed_scenarios as scenarios
from tests.multiprocess import run_on_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="no CUDA device")]
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs")
WORLDS = [w for w in (2, 4) if w <= GPUS]
ALL_LAYOUTS = [name for name, _, _ in scenarios.LAYOUT_CASES]
CASE_NAMES = [name for name, _, _ in scenarios.CASES]


def _nccl(fn, world: int, *args):
    return run_on_ranks(fn, world, *args, backend="nccl", timeout=300)


# ------------------------------------------------------------------ one GPU


def test_dmuon_on_one_gpu_is_bitwise_equal_to_torch_muon():
    from dmuon import DMuon

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator).cuda() for shape in ((64, 32), (32, 96), (48, 48))]
    grads = [[torch.randn(w.shape, generator=generator).cuda() for w in weights] for _ in range(3)]
    ours = [nn.Parameter(w.clone()) for w in weights]
    theirs = [nn.Parameter(w.clone()) for w in weights]
    dmuon = DMuon([{"params": ours, "use_muon": True}], lr=0.02, weight_decay=0.1, ns_dtype="bfloat16")
    muon = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    for step_grads in grads:
        for a, b, g in zip(ours, theirs, step_grads):
            a.grad, b.grad = g.clone(), g.clone()
        dmuon.step()
        muon.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _adamw_on_cuda(make, steps: range, params=None) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    """An optimizer over two CUDA vectors (sizes the fused kernel and the loop round apart),
    stepped with the same grads whatever it is."""
    if params is None:
        generator = torch.Generator().manual_seed(2)
        params = [nn.Parameter(torch.randn(n, generator=generator).cuda()) for n in (1037, 231)]
    optimizer = make(params)
    for step in steps:
        for index, param in enumerate(params):
            generator = torch.Generator().manual_seed(100 * step + index)
            param.grad = torch.randn(param.shape, generator=generator).cuda()
        optimizer.step()
    return optimizer, params


def test_a_fused_adamw_part_on_cuda_steps_with_torchs_fused_adamw_bits():
    from dmuon import DMuon

    adamw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ours, mine = _adamw_on_cuda(lambda ps: DMuon([{"params": ps, "use_muon": False}], fused=True, **adamw), range(3))
    theirs, reference = _adamw_on_cuda(lambda ps: torch.optim.AdamW(ps, fused=True, **adamw), range(3))
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))
    assert all(ours.state[p]["step"].is_cuda for p in mine)


def test_a_host_step_counter_loaded_into_a_fused_dmuon_moves_to_the_gpu_exactly():
    """A checkpoint of a run without fused keeps its step counters on the host; the fused
    kernel reads them on the GPU."""
    from dmuon import DMuon

    adamw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    unfused, params = _adamw_on_cuda(lambda ps: DMuon([{"params": ps, "use_muon": False}], **adamw), range(2))
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    fused, _ = _adamw_on_cuda(lambda ps: DMuon([{"params": ps, "use_muon": False}], fused=True, **adamw), range(0),
                              twins)
    fused.load_state_dict(unfused.state_dict())
    _adamw_on_cuda(lambda ps: fused, range(2, 3), twins)
    assert [fused.state[p]["step"].item() for p in twins] == [3.0, 3.0]
    assert all(fused.state[p]["step"].is_cuda for p in twins)


def _bf16_step(foreach: bool, cautious: bool) -> list[torch.Tensor]:
    from dmuon import DMuon

    generator = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.randn(shape, generator=generator).to("cuda", torch.bfloat16))
              for shape in ((64, 32), (32, 96), (48, 48))]
    optimizer = DMuon([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.1, foreach=foreach,
                      cautious_weight_decay=cautious)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to("cuda", torch.bfloat16)
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("cautious", [False, True], ids=["plain decay", "cautious decay"])
def test_bf16_parameters_decay_by_the_fp32_factor_on_the_list_path_too(cautious):
    """The list decay once multiplied by a CUDA fp32 scalar that CUDA read as bf16 (0.998 ->
    0.99609375); the per-tensor path multiplies by the Python number, in fp32."""
    assert all(torch.equal(a, b) for a, b in zip(_bf16_step(True, cautious), _bf16_step(False, cautious)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_with_cautious_decay_never_waits_for_the_gpu(dtype):
    from dmuon import DMuon

    params = [nn.Parameter(torch.randn(32, 48, device="cuda", dtype=dtype)),
              nn.Parameter(torch.randn(48, device="cuda"))]
    optimizer = DMuon([{"params": params[:1], "use_muon": True}, {"params": params[1:], "use_muon": False}],
                      lr=0.02, weight_decay=0.1, cautious_weight_decay=True)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()  # the first step makes state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _int8_awkward_rows(dtype: torch.dtype) -> torch.Tensor:
    """Seeded rows of 1000 columns (a short last block) over 70 decades, fp32's subnormals among
    them, with a row of zeros and rows whose scale underflows to 0 or is subnormal."""
    generator = torch.Generator().manual_seed(59)
    x = torch.randn(96, 1000, generator=generator) * torch.logspace(-40, 30, 96).unsqueeze(1)
    x[0] = 0.0
    x[1, :128] = torch.rand(128, generator=generator) * 1e-44
    x[2, :128] = torch.rand(128, generator=generator) * 143 * 2.0**-149
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_momentum_quantized_on_the_gpu_has_the_cpus_bits(dtype, monkeypatch):
    # Issue 59, items 1 and 5: CUDA's int8 values and scales are the CPU's, bit for bit, one
    # tensor at a time and in a batched store of 21 chunks of 32 blocks (a scale made as
    # x * (1 / 127), CUDA's form for a Python-number divisor, would move about 4.5% of the 768
    # scales); and the batched store never waits for the GPU.
    from dmuon.numerics import momentum_storage as storage

    x = _int8_awkward_rows(dtype)
    (cpu_values, cpu_scales), (gpu_values, gpu_scales) = storage.quantize_int8(x), storage.quantize_int8(x.cuda())
    assert torch.equal(gpu_values.cpu(), cpu_values)
    assert torch.equal(gpu_scales.cpu().view(torch.int32), cpu_scales.view(torch.int32))
    monkeypatch.setattr(storage, "ROUNDING_CHUNK_NUMEL", 32 * storage.INT8_BLOCK)
    flat = x[:, :896].reshape(-1)  # whole blocks, 672 of them
    cpu_values, cpu_scales = storage._quantize_flat(flat)
    on_gpu = flat.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu_values, gpu_scales = storage._quantize_flat(on_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu_values.cpu(), cpu_values)
    assert torch.equal(gpu_scales.cpu().view(torch.int32), cpu_scales.view(torch.int32))


def test_an_int8_store_captured_in_a_cuda_graph_replays_with_the_cpus_bits():
    # Issue 59, item 1: the store's device constants (127, the rounding magic) are fill kernels,
    # captured with it and made again at every replay, not host copies a capture refuses.
    from dmuon.numerics import momentum_storage as storage

    first, second = _int8_awkward_rows(torch.float32)[:, :896], _int8_awkward_rows(torch.float32)[:, 104:]
    static = first.reshape(-1).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        storage._quantize_flat(static)  # the warm-up torch.cuda.graph asks for
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, scales = storage._quantize_flat(static)
    static.copy_(second.reshape(-1).cuda())
    graph.replay()
    want_values, want_scales = storage._quantize_flat(second.reshape(-1))
    assert torch.equal(values.cpu(), want_values)
    assert torch.equal(scales.cpu().view(torch.int32), want_scales.view(torch.int32))


@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "int8"])
def test_a_low_precision_momentum_holds_at_most_one_chunk_of_copies_above_the_fp32_peak(momentum_dtype):
    # Issue 59, item 2: off the owner exchange (plain tensors here) a momentum kept narrow is
    # read into fp32 a chunk at a time (dmuon.state.kept_state.read_chunks): 8 matrices of
    # 2048 x 2048 (32 Mi elements) are two chunks, so the step's peak is at most one chunk's
    # fp32 copies (64 MiB) above fp32 momentum's; read at once they would add 128 MiB.
    from dmuon import DMuon
    from dmuon.state.kept_state import READ_CHUNK_NUMEL

    def step_peak(dtype: str | None) -> int:
        generator = torch.Generator().manual_seed(5)
        params = [nn.Parameter(torch.randn(2048, 2048, generator=generator).cuda()) for _ in range(8)]
        optimizer = DMuon([{"params": params, "use_muon": True}], lr=0.02, momentum_dtype=dtype)
        for step in range(2):
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator).cuda()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            optimizer.step()
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    assert step_peak(momentum_dtype) <= step_peak(None) + 4 * READ_CHUNK_NUMEL


def test_one_rank_nccl_group_runs_every_layout_locally():
    result = _nccl(scenarios.layout_exactness, 1, ALL_LAYOUTS, 1 << 27)[0]
    assert result["equal"] == dict.fromkeys(ALL_LAYOUTS, True)


def test_a_captured_step_replays_bitwise_like_eager_steps():
    """Not yet run on a GPU (no session has had one): the step is meant to be capture-ready
    (no host read, no host collective, the same device program every step)."""
    assert _nccl(scenarios.cuda_graph_replay, 1) == [True]


def test_a_captured_capturable_step_replays_a_schedule_and_a_skipped_step_bitwise_like_eager_steps():
    """Issue 42, item 7: 20 steps, a cosine LR and a weight-decay schedule, a NaN grad at one
    step, one capture (dmuon.capture.cuda_graphs). Not yet run on a GPU."""
    from tests import capturable_scenarios

    (result,) = _nccl(capturable_scenarios.cuda_graph_schedule_replay, 1)
    assert result == {"equal": True, "skipped": (1, 1)}


def test_a_captured_step_guards_its_replays_counts_skips_once_and_reaches_loaded_state():
    """Issue 50, items 1 to 4 and 6 on a GPU (tests/capturable_scenarios.py says what each
    finding means); their host logic is also checked on the CPU, tests/test_cuda_graphs.py."""
    from tests import capturable_scenarios

    (found,) = _nccl(capturable_scenarios.cuda_graph_guards, 1)
    assert found == {"lr_numbers": True, "load_reaches_graph": True, "skipped_once": True, "replaced_grad": True,
                     "side_stream_joined": True}


# ------------------------------------------------------------------ several GPUs


@needs_two
@pytest.mark.parametrize("world", WORLDS)
def test_every_layout_is_bitwise_equal_to_one_gpu_on_nccl(world):
    result = _nccl(scenarios.layout_exactness, world, ALL_LAYOUTS, 1 << 27)[0]
    assert result["equal"] == dict.fromkeys(ALL_LAYOUTS, True)
    assert set(result["paths"].values()) == {"all_to_all"}


@needs_two
def test_ranks_that_own_nothing_in_a_batch_still_hand_nccl_gpu_buffers():
    """The landed planner's crash: empty send buffers fell back to the CPU."""
    world = max(WORLDS)
    result = _nccl(scenarios.layout_exactness, world, ALL_LAYOUTS, 64)[0]
    assert result["idle_in_some_batch"]
    assert result["equal"] == dict.fromkeys(ALL_LAYOUTS, True)


@needs_two
def test_fast_and_reference_paths_match_one_gpu_on_nccl():
    world = max(WORLDS)
    results = _nccl(scenarios.exactness, world)[0]
    for comm in ("all_to_all", "redistribute"):
        assert results[("fsdp", comm)] == dict.fromkeys(CASE_NAMES, True)


@needs_two
def test_real_fully_shard_training_matches_one_gpu_on_nccl():
    equal = _nccl(scenarios.fsdp2_training, max(WORLDS))[0]
    assert equal == dict.fromkeys(scenarios.TINY_LM_PARAMS, True)


@needs_two
def test_awkward_grads_give_the_same_outcome_on_every_gpu():
    ranks = _nccl(scenarios.robustness, 2)
    for rank in ranks:
        assert rank["none_everywhere_unchanged"] and rank["none_everywhere_no_state"]
        assert rank["disagree_step"] is None and rank["disagree_unchanged"]
        assert rank["disagree_error"].startswith("RuntimeError: DMuon: ranks disagree")
        assert rank["usable_after_errors"]
        assert rank["nan_error"] is None and rank["nan_matrix_all_nan"] and rank["nan_others_finite"]
        assert rank["lr0_unchanged"]


@needs_two
def test_every_gpu_runs_the_same_collectives_whatever_its_grads():
    ranks = _nccl(scenarios.collective_sequences, max(WORLDS))
    for index, what in enumerate(scenarios.SEQUENCE_STEPS):
        seen = [scenarios.across_ranks(rank["steps"][index]) for rank in ranks]
        assert all(s == seen[0] for s in seen), (what, seen)
        if what in scenarios.SEQUENCE_LIKE_CLEAN:
            assert all(rank["steps"][index] == rank["twin"][index] for rank in ranks), what
    assert ranks[0]["steps"][0]
