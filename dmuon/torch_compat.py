"""Every private PyTorch API dmuon uses, in one place, with the torch versions it was
checked on.

torch promises nothing for names that start with an underscore, so none is imported
anywhere else in dmuon (``tests/test_package_boundaries.py`` checks it). When a new torch
moves one, this module is the one to change, and its tests say which entry broke.

| name | what dmuon uses it for | checked on |
| --- | --- | --- |
| ``compute_local_shape_and_global_offset`` | DTensor's own answer for a rank's block, to check the plan's layout at the first step | 2.11.0, 2.13.0, 2.15.0 |
| ``StridedShard`` (``_StridedShard``) | FSDP2 over a TP-sharded weight: a placement the layout rules must read | 2.11.0, 2.13.0, 2.15.0 |
| ``scalar_dtype`` (``torch.optim.optimizer._get_scalar_dtype``) | the dtype of AdamW's ``step`` state, as torch.optim.AdamW makes it | 2.11.0, 2.13.0, 2.15.0 |
| ``mkldnn_bf16_supported`` (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) | whether oneDNN has a bf16 GEMM at all for this CPU (``ns_dtype="auto"``: none means fp32; on x86 it is True also where bf16 is only emulated, so the two queries below decide there) | 2.11.0, 2.13.0, 2.15.0 |
| ``avx512_bf16_supported``, ``amx_tile_supported`` (``torch.cpu._is_avx512_bf16_supported``, ``torch.cpu._is_amx_tile_supported``) | whether an x86 CPU's bf16 GEMM is native (AVX512_BF16, AMX) or emulated by oneDNN (AVX-512 without them: ``ns_dtype="auto"`` picks fp32 there); False where torch lacks the query | 2.11.0, 2.13.0, 2.15.0 |
| ``mkldnn_fp16_supported`` (``torch.ops.mkldnn._is_mkldnn_fp16_supported``) | whether a CPU has a native fp16 GEMM (the dtype of Gram Newton-Schulz) | 2.11.0, 2.13.0, 2.15.0 |
| ``FakeTensorMode``, ``FakeTensor`` (``torch._subclasses.fake_tensor``) | ``python -m dmuon.tools.dry_run``: CUDA tensors without data | 2.11.0, 2.15.0 (needs a CUDA build) |
| ``fake_store`` (``torch.testing._internal.distributed.fake_pg.FakeStore``) | ``dmuon.tools.dry_run``: one process as rank r of any world size (backend ``"fake"``) | 2.11.0, 2.15.0 |
| ``TorchDispatchMode`` (``torch.utils._python_dispatch``) | ``dmuon.tools.dry_run``: sees every op of a step (syncs, launches, collectives, memory) | 2.11.0, 2.13.0, 2.15.0 |
| ``resolve_process_group`` (``torch.distributed.distributed_c10d._resolve_process_group``) | ``dmuon.tools.dry_run``: the group of a functional collective (DTensor's), named by a string | 2.11.0, 2.15.0 |
| ``default_foreach`` (``torch.utils._foreach_utils._get_foreach_kernels_supported_devices``) | ``DMuon(foreach=None)``: torch.optim's own per-device choice of the list path (CUDA: yes, CPU: no) | 2.11.0, 2.13.0, 2.15.0 |
| ``default_foreach_for`` (``torch.optim.optimizer._default_to_fused_or_foreach``) | the AdamW part: torch's list-path choice made on the parameters as given (DTensors, or fake tensors in the dry run), then applied to their local shards | 2.11.0, 2.13.0, 2.15.0 |
| ``fake_tensors_take_the_list_path`` (``torch.optim.optimizer._foreach_supported_types``) | ``dmuon.tools.dry_run``: a plain parameter's fake stand-in takes the AdamW part's list path as the real tensor would (the list names the types torch's rule takes) | 2.13.0, 2.15.0 |
| ``fused_adamw_devices`` (``torch.utils._foreach_utils._get_fused_kernels_supported_devices``) | ``DMuon(fused=True)``: the device types torch.optim.AdamW(fused=True) takes, checked at construction (CUDA and CPU among them) | 2.11.0, 2.13.0, 2.15.0 |
| ``capturable_devices`` (``torch.optim.optimizer._get_capturable_supported_devices``) | ``DMuon(capturable=True)``: the device types torch.optim.AdamW(capturable=True) steps (CUDA among them, not the CPU); the AdamW part takes torch's capturable path there | 2.11.0, 2.13.0, 2.15.0 |
| ``chunk_cat`` (``torch._chunk_cat``) | the owner exchange: many blocks (any shapes, one dtype) flattened into a send buffer in one op, as FSDP2 packs its reduce-scatter | 2.11.0, 2.13.0, 2.15.0 |
| ``local_of`` (``DTensor._local_tensor``) | the step's elementwise rules read and write each DTensor's local tensor itself: ``to_local()`` makes a new view (an op) per call, per parameter per step | 2.11.0, 2.13.0, 2.15.0 |
| ``flattened_group`` (``DeviceMesh._flatten``) | a group of an n-D mesh's ranks (a pipeline stage's mesh), made as DeviceMesh makes its own: every rank of the root mesh makes every slice's group together, so no rank waits in a group creation its peers skip | 2.11.0, 2.13.0, 2.15.0 |
| ``dtensor_where_it_is`` (``DTensor(local, DTensorSpec(...))``, as FSDP2's ``_from_local_no_grad``) | NorMuon's state under FSDP2's CPU offload, and int8 momentum's scales (a shard of a global shape): a DTensor on the device mesh whose local tensor stays where it is (``DTensor.from_local`` moves it to the mesh's device) | 2.11.0, 2.13.0, 2.15.0 |
| ``has_optimizer_hook`` (``Optimizer._optimizer_state_dict_pre_hooks``, ``_optimizer_load_state_dict_pre_hooks``) | DMuon's hooks attached once, also on a copy (torch's hooks do not pickle) | 2.11.0, 2.13.0, 2.15.0 |
| ``host_tensor_ops`` (``torch._subclasses.fake_tensor.unset_fake_temporarily``) | host-side bookkeeping (mesh ranks, shard offsets, agreement counts) on real CPU tensors also while a ``FakeTensorMode`` is active (``python -m dmuon.tools.dry_run``) | 2.11.0, 2.13.0, 2.15.0 |
| ``non_overlapping_and_dense`` (``torch._prims_common.is_non_overlapping_and_dense_or_false``) | whether a tensor's elements fill its storage span once each, as torch's multi-tensor kernels require of every operand (``ForeachUtils.h``) | 2.11.0, 2.13.0, 2.15.0 |
| ``make_contiguous_strides_for`` (``torch._prims_common``) | the contiguous strides of a global shape, for a shard's DTensor metadata (``dtensor_where_it_is``) | 2.13.0, 2.15.0 |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
# Whether a tensor's elements fill its storage span once each, in any dim order (what torch's
# multi-tensor kernels require of every operand, ``ForeachUtils.h``).
from torch._prims_common import is_non_overlapping_and_dense_or_false as non_overlapping_and_dense
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.fake_tensor import unset_fake_temporarily as host_tensor_ops
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.optim.optimizer import _get_capturable_supported_devices as capturable_devices
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.optim.optimizer import _get_scalar_dtype as scalar_dtype
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as fused_adamw_devices
from torch.utils._python_dispatch import TorchDispatchMode

# The lowest torch dmuon supports (pyproject.toml's requirement) and the newest it was tested on.
OLDEST_TESTED_TORCH = "2.11.0"
NEWEST_TESTED_TORCH = "2.15.0"

__all__ = ["FakeTensor", "FakeTensorMode", "StridedShard", "TorchDispatchMode", "capturable_devices", "chunk_cat",
           "compute_local_shape_and_global_offset", "default_foreach", "default_foreach_for", "dtensor_where_it_is", "fake_store", "fake_tensors_take_the_list_path", "flattened_group", "fused_adamw_devices", "host_tensor_ops", "is_fake",
           "local_of",
           "avx512_bf16_supported", "amx_tile_supported", "mkldnn_bf16_supported", "mkldnn_fp16_supported", "resolve_process_group", "scalar_dtype"]


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN has a bf16 GEMM for this CPU (AVX-512, AMX, Arm BF16): on AVX-512 without
    AVX512_BF16 that GEMM is emulated, slower than fp32 (see ``dmuon.numerics.cpu_bf16``)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def mkldnn_fp16_supported() -> bool:
    """Whether oneDNN has an fp16 GEMM for this CPU (AVX-512 FP16, AMX-FP16, Arm FP16)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def avx512_bf16_supported() -> bool:
    """Whether the CPU has AVX512_BF16 (cpuinfo, as torch reads it): a native bf16 dot
    product. False where this torch has no such query (then the caller falls back to fp32)."""
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def amx_tile_supported() -> bool:
    """Whether the CPU has AMX tiles (Sapphire Rapids and newer, all with AMX-BF16).
    False where this torch has no such query."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def default_foreach(device: torch.device) -> bool:
    """Whether torch.optim takes its foreach path by default for plain tensors on ``device``."""
    return device.type in _get_foreach_kernels_supported_devices()


def fake_tensors_take_the_list_path() -> None:
    """Let torch.optim's default list-path rule take a ``FakeTensor`` as the plain tensor it
    stands for (the dry run): the rule lists the tensor types it takes (``torch.Tensor``,
    ``Parameter``, and ``DTensor``, which registers itself the same way), and a plain
    tensor's fake stand-in is a subclass it does not list."""
    if FakeTensor not in _optim_foreach_types:
        _optim_foreach_types.append(FakeTensor)


def default_foreach_for(params: list[torch.Tensor]) -> bool:
    """Whether torch.optim's functional optimizers take the list path for ``params`` when
    given neither ``foreach`` nor ``fused``: their types and devices decide."""
    return _default_to_fused_or_foreach(params, False, use_fused=False)[1]


def chunk_cat(tensors: list[torch.Tensor], out: torch.Tensor, chunks: int = 1) -> None:
    """Write ``tensors`` (one dtype, any shapes and strides), flattened and one after
    another, into the 1-D ``out`` (any dtype: the values are cast as ``copy_`` casts).
    With ``chunks`` (dividing every tensor's dim 0): chunk ``k`` of every tensor, then
    chunk ``k + 1`` of every tensor, and so on (FSDP2's reduce-scatter layout)."""
    torch._chunk_cat(tensors, 0, chunks, out=out.view(chunks, -1))


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the object it holds, no new view), or a plain tensor
    itself: what the step's rules read and write, under ``no_grad``."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def dtensor_where_it_is(local: torch.Tensor, mesh: "torch.distributed.device_mesh.DeviceMesh",
                        placements: tuple, shape: tuple[int, ...] | None = None) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False)`` without moving
    ``local`` to the mesh's device: FSDP2's CPU offload keeps host shards on a device mesh.
    ``shape``: the global shape (contiguous) where ``local`` is a shard (default: ``local``'s)."""
    meta = (TensorMeta(local.shape, local.stride(), local.dtype) if shape is None
            else TensorMeta(torch.Size(shape), make_contiguous_strides_for(shape), local.dtype))
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def flattened_group(mesh: "torch.distributed.device_mesh.DeviceMesh", name: str) -> dist.ProcessGroup:
    """The group of every rank of ``mesh`` (n-D, with dim names), from ``mesh._flatten(name)``:
    made once per root mesh and name, every rank of the root mesh taking part."""
    return mesh._flatten(name).get_group()


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (``python -m dmuon.tools.dry_run``): it has no
    values to read."""
    return isinstance(tensor, FakeTensor)


def fake_store() -> dist.Store:
    """The store of PyTorch's fake process group (``init_process_group("fake", ...)``);
    imported on demand: it lives in torch's internal testing package."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective names (DTensor's collectives carry
    the group's name, not the group)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def has_optimizer_hook(optimizer: torch.optim.Optimizer, kind: str, hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is already one of ``optimizer``'s ``kind`` pre-hooks (``"state_dict"`` or
    ``"load_state_dict"``): torch keeps them in private dicts and offers no query."""
    hooks = {"state_dict": optimizer._optimizer_state_dict_pre_hooks,
             "load_state_dict": optimizer._optimizer_load_state_dict_pre_hooks}[kind]
    return hook in hooks.values()
