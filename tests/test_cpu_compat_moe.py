"""The MoE part of the CPU compatibility layer (``torchtitan_ext.titan02.cpu_compat``, patches 5 and 6).

Patch 5 counts tokens per expert on integer CPU tensors (``integer_histc``) with
the counts CUDA's integer ``histc`` gives; patch 6 sends EP's token permutation
to TorchTitan's CPU implementation. Importing ``torchtitan_ext`` (as this file
does) installs them on a CPU-only machine; most tests wrap the stock functions
themselves, so they do not depend on that.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan_ext.titan02.cpu_compat import (
    _histc_with_integer_cpu_support,
    _permute_indices_on_cpu_when_needed,
    needs_cpu_compat,
)
from torchtitan_ext.integer_histc import integer_histc

pytestmark = pytest.mark.unit

# torch.histc as torch ships it (the import above may have wrapped it).
STOCK_HISTC = getattr(torch.histc, "__wrapped__", torch.histc)


def test_histc_of_expert_indices_counts_the_tokens_of_each_expert():
    experts = torch.randint(0, 8, (256, 3), generator=torch.Generator().manual_seed(0))
    # The router's exact call: bins = E over [0, E].
    counts = integer_histc(experts.view(-1), bins=8, min=0, max=8)
    assert counts.dtype == torch.int64
    assert torch.equal(counts, torch.bincount(experts.view(-1), minlength=8))


@pytest.mark.parametrize(("bins", "lo", "hi"), [(8, 0, 8), (3, 0, 10), (5, -7, 12), (4, 2, 6), (7, 0, 0)])
def test_integer_histc_counts_as_float_histc_does_on_the_same_values(bins, lo, hi):
    # Small integers are exact in float64, where CPU histc is implemented: same bins, same edges.
    values = torch.randint(-10, 15, (500,), generator=torch.Generator().manual_seed(bins))
    expected = STOCK_HISTC(values.double(), bins=bins, min=lo, max=hi).long()
    assert torch.equal(integer_histc(values, bins, lo, hi), expected)


def test_integer_histc_keeps_the_inputs_dtype():
    values = torch.tensor([0, 1, 1, 3], dtype=torch.int32)
    counts = integer_histc(values, bins=4, min=0, max=4)
    assert counts.dtype == torch.int32 and counts.tolist() == [1, 2, 0, 1]


def test_integer_histc_of_one_repeated_value_widens_the_range_by_one_each_side():
    # min == max == the only value: range [v - 1, v + 1], as CUDA does; v falls in the middle bin.
    assert integer_histc(torch.tensor([5, 5, 5]), bins=3).tolist() == [0, 3, 0]


def test_integer_histc_of_an_empty_tensor_is_all_zeros():
    assert integer_histc(torch.tensor([], dtype=torch.int64), bins=4, min=0, max=4).tolist() == [0, 0, 0, 0]


def test_integer_histc_rejects_max_below_min():
    with pytest.raises(RuntimeError, match="max must be larger than min"):
        integer_histc(torch.tensor([1, 2]), bins=2, min=3, max=1)


@pytest.mark.skipif(not needs_cpu_compat(), reason="the layer is a no-op with an accelerator")
def test_importing_torchtitan_ext_on_a_cpu_machine_installs_the_integer_histc():
    assert torch.histc is not STOCK_HISTC
    assert torch.histc(torch.tensor([2, 0, 2]), bins=3, min=0, max=3).tolist() == [1, 0, 2]


@pytest.mark.skipif(not needs_cpu_compat(), reason="the layer is a no-op with an accelerator")
def test_importing_torchtitan_ext_on_a_cpu_machine_routes_eps_permutation_to_the_cpu_version():
    from torchtitan.models.moe import kernels, utils

    assert utils.generate_permute_indices.__wrapped__ is kernels.generate_permute_indices


def test_patched_histc_counts_integer_cpu_tensors_the_stock_kernel_rejects():
    with pytest.raises(NotImplementedError):
        STOCK_HISTC(torch.tensor([0, 1, 1]), bins=2, min=0, max=2)
    histc = _histc_with_integer_cpu_support(STOCK_HISTC)
    assert histc(torch.tensor([0, 1, 1]), bins=2, min=0, max=2).tolist() == [1, 2]


def test_patched_histc_leaves_floating_tensors_to_the_stock_kernel():
    values = torch.rand(100, generator=torch.Generator().manual_seed(1))
    histc = _histc_with_integer_cpu_support(STOCK_HISTC)
    assert torch.equal(histc(values, bins=7, min=0, max=1), STOCK_HISTC(values, bins=7, min=0, max=1))


def test_patched_histc_writes_into_out():
    histc = _histc_with_integer_cpu_support(STOCK_HISTC)
    out = torch.empty(0, dtype=torch.int64)
    result = histc(torch.tensor([0, 2, 2]), bins=3, min=0, max=3, out=out)
    assert result is out and out.tolist() == [1, 0, 2]


def test_the_moe_router_runs_on_cpu_with_the_patched_histc(monkeypatch):
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    monkeypatch.setattr(torch, "histc", _histc_with_integer_cpu_support(STOCK_HISTC))
    router = TokenChoiceTopKRouter(dim=16, num_experts=4, num_expert_groups=None, num_limited_groups=None,
                                   top_k=2, score_func="softmax", route_norm=False, route_scale=1.0,
                                   gate_bias=False)
    _, experts, counts = router(torch.randn(10, 16, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(counts, torch.bincount(experts.view(-1), minlength=4))


def test_permute_indices_of_cpu_counts_use_torchtitans_cpu_implementation():
    from torchtitan.models.moe.kernels import generate_permute_indices

    # Tokens per (rank, local expert), 2 ranks x 4 experts, as EP's all-to-all delivers them.
    counts = torch.tensor([4, 2, 1, 3, 1, 2, 3, 4])
    patched = _permute_indices_on_cpu_when_needed(generate_permute_indices)
    expected = generate_permute_indices(counts, 4, 2, 64, 8, use_cpu=True)
    for got, want in zip(patched(counts, 4, 2, 64, 8), expected):
        assert torch.equal(got, want)
