"""The update rules under a device mask (``dmuon.numerics.masked_updates``): where a
parameter's mask holds, the bits of the unmasked rule; where it does not, the tensor's
own bits. For every float dtype a parameter or its momentum may have."""

from __future__ import annotations

import pytest
import torch

from dmuon.numerics.masked_updates import mask_, masked_apply_, masked_momentum_
from dmuon.numerics.update_lists import apply_muon_updates_, momentum_

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [(6, 10), (0, 10), (3, 7)]  # an empty shard included
OKS = [True, False, True]


def tensors(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


def oks() -> list[torch.Tensor]:
    return list(torch.tensor(OKS).unbind())


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_momentum_is_the_momentum_where_ok_and_leaves_the_buffer_elsewhere(dtype):
    bufs, grads = tensors(0, dtype), tensors(1, dtype)
    expected = [b.clone() for b in bufs]
    momentum_(expected, grads, 0.95, foreach=True)
    masked = [b.clone() for b in bufs]
    masked_momentum_(masked, grads, 0.95, oks())
    for got, want, before, ok in zip(masked, expected, bufs, OKS):
        assert bits(got) == bits(want if ok else before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cautious", [False, True], ids=["plain decay", "cautious decay"])
def test_masked_apply_is_the_update_where_ok_and_leaves_the_parameter_elsewhere(dtype, cautious):
    params = tensors(2, dtype)
    orthos = [o.to(torch.bfloat16) for o in tensors(3, torch.float32)]
    expected = [p.clone() for p in params]
    apply_muon_updates_(expected, orthos, 0.02, 0.1, 1.5, cautious, foreach=True)
    masked_orthos = [o.clone() for o in orthos]
    mask_(masked_orthos, oks())
    masked = [p.clone() for p in params]
    masked_apply_(masked, masked_orthos, oks(), 0.02, 0.1, 1.5, cautious, foreach=True)
    for got, want, before, ok in zip(masked, expected, params, OKS):
        assert bits(got) == bits(want if ok else before)


def test_mask_zeroes_only_the_results_whose_mask_is_false():
    results = [torch.ones(4, 3, dtype=torch.bfloat16) for _ in OKS]
    mask_(results, oks())
    assert [bool(r.eq(1).all()) for r in results] == OKS
    assert bool(results[1].eq(0).all())
