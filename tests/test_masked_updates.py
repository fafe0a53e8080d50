"""The update rules under a device mask (``dmuon.numerics.masked_updates``): where a
parameter's mask holds, the bits of the unmasked rule; where it does not, the tensor's
own bits, exactly: ``-0.0``, NaN and inf included, and whatever its grad or update holds
(a NaN grad of a masked-off parameter must not leak in). For every float dtype a parameter
or its momentum may have.

Every tensor is non-empty and the masked-off ones would change under the unmasked rule,
so an implementation that ignores the mask fails (``test_the_inputs_would_change_without_the_mask``)."""

from __future__ import annotations

import pytest
import torch

from dmuon.numerics import masked_updates
from dmuon.numerics.masked_updates import mask_
from dmuon.numerics.update_rules import apply_muon_, momentum_

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [(6, 10), (4, 10), (3, 7), (5, 3)]  # every one non-empty: a masked-off one would change
OKS = [True, False, True, False]
SPECIALS = [-0.0, float("nan"), float("inf"), float("-inf"), 0.0]


def tensors(seed: int, dtype: torch.dtype, specials: bool = False) -> list[torch.Tensor]:
    """Seeded tensors; with ``specials``, the masked-off ones start with -0.0, NaN, +-inf, +0.0."""
    generator = torch.Generator().manual_seed(seed)
    out = [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]
    if specials:
        for tensor, ok in zip(out, OKS):
            if not ok:
                tensor.view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS, dtype=dtype)
    return out


def oks(shared: bool = False) -> list[torch.Tensor]:
    """One mask per tensor, or (``shared``) one True and one False tensor, each read by
    several tensors as a step's masks are (the rules then run one list op per mask)."""
    if shared:
        yes, no = torch.tensor(True), torch.tensor(False)
        return [yes if ok else no for ok in OKS]
    return list(torch.tensor(OKS).unbind())


@pytest.fixture(params=["where", "integer lists"])
def select_path(request, monkeypatch):
    """Both ways a select runs: ``torch.where`` per tensor (the CPU's) and integer list ops
    on the bits (CUDA's), the latter forced here on the CPU."""
    if request.param == "integer lists":
        monkeypatch.setattr(masked_updates, "select_by_lists", lambda device: True)
    return request.param


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def bits_nan_as_nan(tensor: torch.Tensor) -> bytes:
    """The bits with every NaN as one pattern: where a mask holds, a NaN parameter stays NaN,
    but its payload is the arithmetic's (a product by a number and by a tensor propagate it
    differently), so there only the NaN's place is compared."""
    return bits(tensor.masked_fill(tensor.isnan(), float("nan")))


def poisoned(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Grads or updates whose masked-off entries hold NaN and inf (a bad grad on a masked step)."""
    out = tensors(seed, dtype)
    for tensor, ok in zip(out, OKS):
        if not ok:
            tensor.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["a mask each", "shared masks"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_momentum_is_the_momentum_where_ok_and_keeps_the_buffers_bits_elsewhere(dtype, foreach, shared,
                                                                                        select_path):
    bufs, grads = tensors(0, dtype, specials=True), poisoned(1, dtype)
    expected = [b.clone() for b in bufs]
    momentum_(expected, grads, 0.95, foreach=True)
    masked = [b.clone() for b in bufs]
    momentum_(masked, grads, 0.95, foreach, oks(shared))
    for got, want, before, ok in zip(masked, expected, bufs, OKS):
        assert bits(got) == bits(want if ok else before)


@pytest.mark.parametrize("shared", [False, True], ids=["a mask each", "shared masks"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cautious", [False, True], ids=["plain decay", "cautious decay"])
def test_masked_apply_is_the_update_where_ok_and_keeps_the_parameters_bits_elsewhere(dtype, cautious, foreach, shared,
                                                                                      select_path):
    params = tensors(2, dtype, specials=True)
    orthos = [o.to(torch.bfloat16) for o in poisoned(3, torch.float32)]
    expected = [p.clone() for p in params]
    apply_muon_(expected, orthos, lr=0.02, weight_decay=0.1, scale=1.5, cautious_weight_decay=cautious, foreach=True)
    masked_orthos = [o.clone() for o in orthos]
    mask_(masked_orthos, oks(shared), foreach)
    masked = [p.clone() for p in params]
    apply_muon_(masked, masked_orthos, lr=0.02, weight_decay=0.1, scale=1.5, cautious_weight_decay=cautious,
                foreach=foreach, oks=oks(shared))
    for got, want, before, ok in zip(masked, expected, params, OKS):
        # Masked off: the bits kept, -0.0 and inf included; a NaN stays NaN (the decay's product by
        # exactly 1 may requiet its payload).
        assert bits_nan_as_nan(got) == bits_nan_as_nan(want if ok else before)
        if not ok:
            assert bits(got.masked_fill(got.isnan(), 0)) == bits(before.masked_fill(before.isnan(), 0))


@pytest.mark.parametrize("shared", [False, True], ids=["a mask each", "shared masks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_zeroes_exactly_the_results_whose_mask_is_false_nan_and_inf_included(dtype, shared, select_path):
    results = [torch.ones(4, 3, dtype=dtype) for _ in OKS]
    for result in results:
        result.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0], dtype=dtype)
    before = [r.clone() for r in results]
    mask_(results, oks(shared), foreach=True)
    for got, was, ok in zip(results, before, OKS):
        assert bits(got) == (bits(was) if ok else bits(torch.zeros_like(was)))


def test_foreach_false_selects_per_tensor_even_where_lists_would_run(monkeypatch):
    """``foreach=False`` (torch's "for-loop") is honoured by the selects too: no list op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(masked_updates, "select_by_lists", lambda device: True)
    bufs, grads = tensors(0, torch.float32), tensors(1, torch.float32)
    with Ops() as ops:
        momentum_(bufs, grads, 0.95, False, oks(shared=True))
        mask_(grads, oks(shared=True), foreach=False)
    assert ops.names and not [name for name in ops.names if "_foreach_" in name]
    with Ops() as ops:
        mask_(grads, oks(shared=True), foreach=True)
    assert [name for name in ops.names if "_foreach_" in name]  # the check above can fail


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_inputs_would_change_without_the_mask(dtype):
    """The tests above can fail: the unmasked rules change every masked-off tensor."""
    bufs, grads = tensors(0, dtype, specials=True), poisoned(1, dtype)
    moved = [b.clone() for b in bufs]
    momentum_(moved, grads, 0.95, foreach=True)
    params = tensors(2, dtype, specials=True)
    stepped = [p.clone() for p in params]
    apply_muon_(stepped, [o.to(torch.bfloat16) for o in poisoned(3, torch.float32)], lr=0.02, weight_decay=0.1,
                scale=1.5, foreach=True)
    for ok, before, after, p_before, p_after in zip(OKS, bufs, moved, params, stepped):
        if not ok:
            assert bits(before) != bits(after) and bits(p_before) != bits(p_after)


def test_masked_momentum_holds_one_chunk_of_emas_at_a_time():
    # Three buffers of 0.6 chunk each: one per chunk. Each chunk's out-of-place EMAs must be
    # freed before the next chunk's are made (found by the dry run: MoE 16B under EP at
    # P = 1024 held two chunks, over its memory bound). Meta tensors: sizes without data.
    from dmuon.tools.dry_run.recorder import StepRecorder
    from dmuon.numerics.update_rules import MASKED_CHUNK_NUMEL

    numel = MASKED_CHUNK_NUMEL * 6 // 10
    bufs = [torch.empty(numel, device="meta") for _ in range(3)]
    grads = [torch.empty(numel, device="meta") for _ in range(3)]
    oks = [torch.empty((), dtype=torch.bool, device="meta") for _ in range(3)]
    with StepRecorder() as recorder:
        momentum_(bufs, grads, 0.9, True, oks)
    # One chunk's EMAs, and the select's 0-dim mask factors beside them (a few bytes).
    assert numel * 4 <= recorder.record.peak_bytes < numel * 4 + 64
