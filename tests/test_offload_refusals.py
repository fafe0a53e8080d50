"""What FSDP2's CPU offload cannot mix is refused at the first step, naming the parameters:
the fast path stages all of its parameters through the host or none, and no other path
stages (``dmuon.exchange.host_staging.check_offload``).

An offloaded shard is a local tensor on another device type than its mesh's. Without a
GPU, a one-rank CPU mesh with ``meta`` local tensors stands in for a CUDA mesh with host
shards: the check compares device types, nothing else.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dmuon.exchange.host_staging import check_offload
from dmuon.plan.paths import ALL_TO_ALL, REDISTRIBUTE
from dmuon.torch_compat import dtensor_where_it_is

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_gloo")]


def sharded(offloaded: bool) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (1,))
    if offloaded:
        return dtensor_where_it_is(torch.empty(4, 4, device="meta"), mesh, (Shard(0),))
    return distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])


def names(params: dict[torch.Tensor, str]):  # noqa: ANN201
    return lambda p: params[p]


def test_a_fast_path_with_offloaded_and_device_shards_is_refused_naming_both():
    host, device = sharded(True), sharded(False)
    with pytest.raises(ValueError, match=r"\['wq'\] are offloaded .* \['wo'\] are not"):
        check_offload({host: ALL_TO_ALL, device: ALL_TO_ALL}, ALL_TO_ALL, names({host: "wq", device: "wo"}))


def test_an_offloaded_parameter_off_the_fast_path_is_refused_naming_its_path():
    host = sharded(True)
    with pytest.raises(ValueError, match=r"\['experts \(redistribute\)'\] take a path that does not stage"):
        check_offload({host: REDISTRIBUTE}, ALL_TO_ALL, names({host: "experts"}))


def test_a_fast_path_offloaded_throughout_is_accepted():
    a, b = sharded(True), sharded(True)
    check_offload({a: ALL_TO_ALL, b: ALL_TO_ALL}, ALL_TO_ALL, names({a: "wq", b: "wo"}))
