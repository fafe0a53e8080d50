"""The AdamW part steps DTensors as their local tensors when every tensor of a parameter
is placed like it (FSDP2's case): AdamW is elementwise, so a shard's update is the bits
DTensor would compute, without DTensor's dispatch per op. A grad placed otherwise (a
``Partial`` sum, which DTensor reduces inside the op) keeps the DTensor lists."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from dmuon.numerics.adamw_rules import _local_lists, adamw_step_

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_gloo")]


def sharded(seed: int) -> DTensor:
    torch.manual_seed(seed)
    return distribute_tensor(torch.randn(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)])


def test_tensors_placed_like_their_parameter_step_as_local_tensors():
    param, grad, m, v = sharded(0), sharded(1), sharded(2), sharded(3).abs()
    lists = _local_lists([param], [grad], [m], [v])
    assert not any(isinstance(t, DTensor) for tensors in lists for t in tensors)
    assert lists[0][0].data_ptr() == param.to_local().data_ptr()  # the shard itself: updated in place


def test_a_partial_grad_keeps_the_dtensor_lists():
    param = sharded(0)
    grad = DTensor.from_local(torch.ones(4, 3), param.device_mesh, [Partial()])
    lists = _local_lists([param], [grad], [sharded(2)], [sharded(3)])
    assert all(isinstance(t, DTensor) for tensors in lists for t in tensors)


def test_a_step_of_dtensors_placed_alike_has_torch_adamws_bits():
    param, grad = sharded(0), sharded(1)
    plain = torch.nn.Parameter(param.to_local().clone())
    plain.grad = grad.to_local().clone()
    settings = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    torch.optim.AdamW([plain], **settings).step()
    adamw_step_([param], [grad], [torch.zeros_like(param)], [torch.zeros_like(param)], [torch.tensor(0.0)],
                **settings)
    assert torch.equal(param.to_local(), plain.detach())
