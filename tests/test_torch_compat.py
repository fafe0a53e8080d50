"""Each private torch API behind dmuon.torch_compat still does what dmuon relies on."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from dmuon import torch_compat

pytestmark = pytest.mark.unit


def test_strided_shard_is_a_placement_with_a_split_factor():
    placement = torch_compat.StridedShard(0, split_factor=2)
    assert (placement.dim, placement.split_factor) == (0, 2)


def test_the_scalar_dtype_is_torch_optims_step_dtype():
    assert torch_compat.scalar_dtype() in (torch.float32, torch.float64)


def test_the_bf16_gemm_check_answers_a_bool():
    assert isinstance(torch_compat.mkldnn_bf16_supported(), bool)


def test_the_fp16_gemm_check_answers_a_bool():
    assert isinstance(torch_compat.mkldnn_fp16_supported(), bool)


def test_torchs_fused_adamw_takes_cpu_and_cuda_parameters():
    assert {"cpu", "cuda"} <= set(torch_compat.fused_adamw_devices())


def test_local_shape_and_offset_of_a_row_shard_on_a_one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        assert torch_compat.compute_local_shape_and_global_offset((6, 4), mesh, [Shard(0)]) == ((6, 4), (0, 0))
    finally:
        dist.destroy_process_group()


def test_the_tested_range_starts_at_the_declared_requirement():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert f"torch>={torch_compat.OLDEST_TESTED_TORCH.rsplit('.', 1)[0]}" in project["dependencies"]


def test_host_tensor_ops_make_real_cpu_tensors_inside_a_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        assert isinstance(torch.zeros(2), FakeTensor)
        with torch_compat.host_tensor_ops():
            counts = torch.tensor([1, 2])
            assert not isinstance(counts, FakeTensor) and counts.tolist() == [1, 2]


def test_host_tensor_ops_do_nothing_outside_a_fake_tensor_mode():
    with torch_compat.host_tensor_ops():
        assert torch.tensor([3]).tolist() == [3]



def test_a_dtensor_where_it_is_wraps_the_local_tensor_itself_on_the_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.zeros(3)
        built = torch_compat.dtensor_where_it_is(local, mesh, (Replicate(),))
        assert isinstance(built, DTensor) and built.to_local().data_ptr() == local.data_ptr()
        assert built.device_mesh is mesh and tuple(built.placements) == (Replicate(),) and built.shape == (3,)
    finally:
        dist.destroy_process_group()
