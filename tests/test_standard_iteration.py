"""The standard Newton-Schulz iteration with its buffers kept between matrices of one shape
(dmuon.numerics.standard_iteration): the bits of the iteration on new tensors, whatever ran
before, and one set of buffers at a time."""

from __future__ import annotations

import pytest
import torch

from dmuon.numerics.newton_schulz import orthogonalize, orthogonalize_row_blocks
from dmuon.numerics.standard_iteration import NewtonSchulzBuffers

pytestmark = pytest.mark.unit

SHAPES = [(8, 32), (32, 32), (112, 32), (32, 112), (7, 5), (5, 7)]


def _update(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=generator)).bfloat16()


@pytest.mark.parametrize("coefficients", ["keller", "polar_express"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_buffered_newton_schulz_has_the_bits_of_newton_schulz_on_new_tensors(dtype, coefficients, steps):
    buffers = NewtonSchulzBuffers()
    for seed, shape in enumerate(SHAPES * 2):  # each shape twice: the second reuses the buffers
        update = _update(shape, seed)
        expected = orthogonalize(update, coefficients, steps, dtype=dtype)
        assert torch.equal(orthogonalize(update, coefficients, steps, dtype=dtype, buffers=buffers), expected), shape


@pytest.mark.parametrize("shape", [(16, 48), (48, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_survive_the_next_matrices_of_their_shape(dtype, shape):
    # In bf16 a wide matrix's last iterate is the result itself: the buffers must let it go.
    buffers = NewtonSchulzBuffers()
    updates = [_update(shape, seed) for seed in range(4)]
    results = [orthogonalize(u, dtype=dtype, buffers=buffers) for u in updates]
    assert all(torch.equal(r, orthogonalize(u, dtype=dtype)) for r, u in zip(results, updates))


def test_expert_stacks_and_head_blocks_share_one_set_of_buffers_with_the_same_bits():
    buffers = NewtonSchulzBuffers()
    stack, heads = _update((3, 24, 16), 1), _update((64, 32), 2)
    assert torch.equal(orthogonalize(stack, buffers=buffers), orthogonalize(stack))
    assert torch.equal(orthogonalize_row_blocks(heads, 16, buffers=buffers), orthogonalize_row_blocks(heads, 16))


def test_a_transposed_view_takes_the_iteration_on_new_tensors():
    buffers = NewtonSchulzBuffers()
    update = _update((48, 16), 3).T
    assert torch.equal(orthogonalize(update, dtype=torch.float32, buffers=buffers),
                       orthogonalize(update, dtype=torch.float32))


def test_one_set_of_buffers_is_held_at_a_time():
    buffers = NewtonSchulzBuffers()
    first = buffers.for_matrix((8, 32), torch.float32, torch.device("cpu"))
    assert buffers.for_matrix((8, 32), torch.float32, torch.device("cpu")) is first
    other = buffers.for_matrix((32, 8), torch.float32, torch.device("cpu"))
    assert other is not first and buffers.for_matrix((32, 8), torch.float32, torch.device("cpu")) is other
