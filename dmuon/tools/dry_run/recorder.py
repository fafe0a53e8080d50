"""What one rank's step does on the device, seen op by op under a fake CUDA run.

:class:`StepRecorder` is a ``TorchDispatchMode`` entered inside the ``FakeTensorMode``:
every op the step dispatches passes through it first (DTensor ops as one op each), so
it records, without trusting any counter of DMuon's own:

- *host syncs*: a device value read on the host (``.item()``, ``.tolist()``,
  ``bool(t)``, ``int(t)``: ``aten._local_scalar_dense``), a copy from the device to the
  CPU (unless ``non_blocking`` into pinned memory: the host reads it later), a copy from pageable (not pinned) CPU memory to the device (CUDA stages it and
  the host waits: ``torch.as_tensor(x, device="cuda")`` is one), or an op whose output
  shape depends on device values (``nonzero``). Each is counted with the line of code
  that made it, and a read gets a placeholder value, so a run counts every sync
  instead of stopping at the first;
- *collectives*: each c10d op (``torch.distributed`` calls and DTensor's functional
  collectives) by op, dtype and device, with the bytes each ``all_to_all`` sends to
  other ranks;
- *device ops*: ops that would launch a CUDA kernel (views, allocations and metadata
  queries launch none; a ``torch._foreach_*`` op counts once where torch takes its
  multi-tensor path, lists of one dtype, and once per tensor where it falls back to a
  loop; a concatenation (``cat``, ``_chunk_cat``) counts once per input where CUDA's
  kernel would cast them one ``copy_`` at a time);
- *precision hazards*: an op given a 0-dim tensor on the device of a wider floating
  dtype than its bf16 or fp16 tensors (a ``torch._foreach_*`` scalar tensor included):
  CUDA reads such an operand in the tensors' own dtype (0.998 becomes 0.99609375 in
  bf16), where a CPU scalar tensor or a Python number keeps the opmath precision;
- *memory*: every device storage the step allocates, live from the op that made it
  until its last tensor dies; the peak is what the step holds above what existed
  before it (parameters, grads, state);
- *mixed devices*: an op given a CPU tensor (other than a 0-dim scalar, which torch
  accepts) next to a CUDA one: what gloo forgives and NCCL does not;
- *offload waits*: under FSDP2's CPU offload, each wait ``dmuon.exchange.host_staging``
  announces (the host computes with what the device made: docs/dry_run.md, "CPU
  offload"), by kind. Its copies are non-blocking, into pinned memory, so a wait it
  did not announce would show up above as a host sync.

:class:`HostTensorsStayReal` is the other mode of the dry run: while a model is laid
out, ops on real CPU tensors (``DeviceMesh`` bookkeeping) run as real host work
instead of turning into fake tensors whose values cannot be read.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dmuon.exchange.host_staging import listening
from dmuon.torch_compat import (FakeTensor, TorchDispatchMode, host_tensor_ops, non_overlapping_and_dense,
                                 resolve_process_group)

# List ops with a one-kernel form when an operand list is 0-dim tensors of the inputs' dtype.
POINTWISE_0DIM_OPS = ("aten._foreach_addcmul", "aten._foreach_addcdiv")
# List ops whose one kernel takes lists of different dtypes.
CROSS_DTYPE_LIST_OPS = ("aten._foreach_copy",)
# Divisions CUDA computes as a multiplication by the reciprocal when the divisor is a Python
# number or a 0-dim CPU tensor (``BinaryDivTrueKernel.cu``): other bits than the CPU's.
TRUE_DIVISIONS = ("aten.div.Tensor", "aten.div_.Tensor", "aten.div.Scalar", "aten.div_.Scalar", "aten.div.out")
# Ops that allocate or describe but launch no kernel.
NO_KERNEL_OPS = frozenset({
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.empty_like.default", "aten.lift_fresh.default", "prim.device.default",
    "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default", "aten.sym_storage_offset.default",
    "aten.is_same_size.default", "aten.set_.source_Storage_storage_offset", "aten.detach.default",
    "_c10d_functional.wait_tensor.default",
})
LOCAL_SCALAR_DENSE = "aten._local_scalar_dense.default"
# Ops that flatten a list of tensors into one output.
CONCATENATIONS = ("aten.cat", "aten._chunk_cat")
REDUCED_FLOATS = (torch.bfloat16, torch.float16)
# What a host read returns in a dry run: the value is unknowable, the run goes on.
PLACEHOLDERS = {torch.bool: False}
PLACEHOLDER = 1
# Frames of these files are skipped when naming the line that made a host sync.
_OWN_FILES = (str(Path(__file__).resolve()), "torch/")
# Storages made pinned in this process (a fake tensor always says is_pinned() False): a
# host buffer pinned in one step is read by the copies of the next.
_PINNED: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()


@dataclass
class CollectiveRow:
    """The collectives of one kind a step issued."""

    op: str
    dtype: str
    device: str
    count: int = 0
    payload_bytes: int = 0
    """Bytes of the tensors handed to the collective (for ``all_to_all``: what it sends)."""


@dataclass
class StepRecord:
    """What :class:`StepRecorder` saw."""

    host_syncs: list[str] = field(default_factory=list)
    """One entry per host sync: the op and the line of code that made it."""
    mixed_device_ops: list[str] = field(default_factory=list)
    precision_hazards: list[str] = field(default_factory=list)
    """Ops given a wider 0-dim device scalar than their bf16/fp16 tensors, with the line."""
    collectives: dict[tuple[str, str, str], CollectiveRow] = field(default_factory=dict)
    bytes_sent: int = 0
    """Bytes this rank's device ``all_to_all`` calls send to other ranks."""
    device_ops: Counter = field(default_factory=Counter)
    per_tensor_list_ops: Counter = field(default_factory=Counter)
    """``torch._foreach_*`` calls off torch's multi-tensor route (one kernel per tensor), by op."""
    peak_bytes: int = 0
    """The most device bytes the step's own allocations held at once."""
    offload_waits: list[str] = field(default_factory=list)
    """The waits ``dmuon.exchange.host_staging`` announced, by kind, in order."""
    program: list[tuple] = field(default_factory=list)
    """Every op that launches a kernel or talks to other ranks, in order, with its
    tensors' shapes, dtypes and devices: two steps with equal programs dispatch the same
    kernels (what a CUDA graph captures once)."""
    scalars: list[tuple] = field(default_factory=list)
    """Beside each entry of ``program``, the values its launch carries from the host: its
    non-tensor arguments (``alpha=-lr * scale``, a ``lerp`` weight) and the values of the
    0-dim CPU tensors it reads. A CUDA graph replays the captured ones, so two steps
    replay alike only where these are equal too."""


class StepRecorder(TorchDispatchMode):
    """Records a step's host syncs, collectives, device ops and memory (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.record = StepRecord()
        self._live: dict[int, int] = {}  # storage id -> bytes, for storages made during the step
        self._live_bytes = 0
        self._listening: list[Any] = []  # one per entry (a recorder may be entered again)

    def __enter__(self) -> StepRecorder:
        self._listening.append(listening(self.record.offload_waits.append))
        self._listening[-1].__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._listening.pop().__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = str(func)
        tensors = [t for t in _tensors((args, kwargs))]
        on_device = [t for t in tensors if t.device.type != "cpu"]
        if name == LOCAL_SCALAR_DENSE:
            return self._host_read(func, args, on_device)
        if self._writes_from_pageable_memory(name, args, kwargs):
            self.record.host_syncs.append(f"{name} (a copy from pageable host memory) at {_caller()}")
        if on_device:
            self._check_devices(name, tensors)
            if self._waits_for_device(name, args, kwargs) or _data_dependent(func, args):
                self.record.host_syncs.append(f"{name} at {_caller()}")
            if hazard := _scalar_precision_hazard(args, kwargs, tensors):
                self.record.precision_hazards.append(f"{name} {hazard} at {_caller()}")
            if hazard := _host_divisor_hazard(name, args, kwargs):
                self.record.precision_hazards.append(f"{name} {hazard} at {_caller()}")
        if func.namespace in ("c10d", "_c10d_functional"):
            self._collective(name, args, tensors)
        before = {_storage_id(t) for t in on_device}
        out = func(*args, **kwargs)
        outputs = [t for t in _tensors(out) if t.device.type != "cpu"]
        launches, per_tensor = _kernel_launches(func, name, args, outputs)
        if launches:
            self.record.device_ops[name] += launches
            if per_tensor:
                self.record.per_tensor_list_ops[name] += 1
        if launches or func.namespace in ("c10d", "_c10d_functional"):
            self.record.program.append((name, *((tuple(t.shape), t.dtype, t.device.type) for t in tensors)))
            self.record.scalars.append(_scalars((args, kwargs)))
        for tensor in outputs:
            self._track(tensor, before)
        if kwargs.get("pin_memory") or name.startswith("aten._pin_memory"):
            _PINNED.update(_storage(t) for t in _tensors(out))
        return out

    def _writes_from_pageable_memory(self, name: str, args: tuple, kwargs: dict) -> bool:
        """A copy from CPU memory that is not pinned into device memory: CUDA copies it
        through a staging buffer and the host waits for it (``non_blocking`` or not)."""
        ends = _copy_ends(name, args, kwargs)
        return (ends is not None and ends[1] != "cpu" and ends[0].device.type == "cpu"
                and not self._is_pinned(ends[0]))

    def _waits_for_device(self, name: str, args: tuple, kwargs: dict) -> bool:
        """A copy from the device into CPU memory the host waits for: any but a
        ``non_blocking`` ``copy_`` into pinned memory (its value is read later, after an event)."""
        if not _reads_to_host(name, args, kwargs):
            return False
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return not (name.startswith("aten.copy_") and non_blocking and self._is_pinned(args[0]))

    def _is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() or _storage(tensor) in _PINNED

    def _host_read(self, func, args, on_device: list[torch.Tensor]):  # noqa: ANN001, ANN202
        tensor = args[0]
        if on_device:
            self.record.host_syncs.append(f"{func} at {_caller()}")
        elif not isinstance(tensor, FakeTensor):
            return func(*args)  # a real CPU value: plain host work
        return PLACEHOLDERS.get(tensor.dtype, PLACEHOLDER)

    def _check_devices(self, name: str, tensors: list[torch.Tensor]) -> None:
        if name.startswith(("aten.copy_", "aten._to_copy")):
            return  # a transfer between host and device, not compute on both (checked as a sync above)
        if any(t.device.type == "cpu" and t.ndim > 0 for t in tensors):
            self.record.mixed_device_ops.append(f"{name} at {_caller()}")

    def _collective(self, name: str, args: tuple, tensors: list[torch.Tensor]) -> None:
        if not tensors or name.endswith("wait_tensor.default"):
            return
        first = tensors[0]
        key = (name, str(first.dtype).removeprefix("torch."), first.device.type)
        row = self.record.collectives.setdefault(key, CollectiveRow(*key))
        row.count += 1
        if "alltoall_base_" in name:  # (output, input, group, output_splits, input_splits, ...)
            send, group, splits = args[1], dist.ProcessGroup.unbox(args[2]), args[4]
            row.payload_bytes += _nbytes(send)
            if send.device.type != "cpu":
                per_rank = list(splits) or [send.numel() // group.size()] * group.size()
                row_bytes = _nbytes(send) // max(send.numel(), 1)
                self.record.bytes_sent += (sum(per_rank) - per_rank[group.rank()]) * row_bytes
        elif "all_to_all_single" in name:  # functional: (input, output_splits, input_splits, group_name)
            send, splits, group = args[0], args[2], resolve_process_group(args[3])
            row.payload_bytes += _nbytes(send)
            if send.device.type != "cpu":
                row_bytes = _nbytes(send) // max(send.numel(), 1) * (send.numel() // max(send.shape[0], 1))
                self.record.bytes_sent += (sum(splits) - splits[group.rank()]) * row_bytes
        else:
            row.payload_bytes += sum(_nbytes(t) for t in tensors)

    def _track(self, tensor: torch.Tensor, existing: set[int]) -> None:
        """Count a storage the step made, until Python frees it."""
        storage = _storage(tensor)
        key = id(storage)
        if key in existing or key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self._live_bytes += nbytes
        self.record.peak_bytes = max(self.record.peak_bytes, self._live_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self._live_bytes -= self._live.pop(key, 0)


class HostTensorsStayReal(TorchDispatchMode):
    """Inside a ``FakeTensorMode``: an op on real CPU tensors only (or a CPU factory)
    runs as real host work (``DeviceMesh`` computes coordinates this way); every
    other op goes on to the fake mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        tensors = list(_tensors((args, kwargs)))
        device = kwargs.get("device")
        real = all(not isinstance(t, FakeTensor) and t.device.type == "cpu" for t in tensors)
        if real and (tensors or (device is not None and torch.device(device).type == "cpu")):
            with host_tensor_ops():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _kernel_launches(func: Any, name: str, args: tuple, outputs: list[torch.Tensor]) -> tuple[int, bool]:
    """The CUDA kernels an op would launch, roughly: none for views and allocations, one
    for an op with a device output, and for a foreach op (in place ones return nothing)
    one where torch takes its multi-tensor route (``ForeachUtils.h``,
    ``check_fast_path_restrictions``: every operand of one device and dtype, a scalar
    tensor too, non-overlapping and dense, and the entries at one position of the same
    sizes and strides; its chunking of long lists aside), else one per tensor (its
    per-tensor fallback: a list of 0-dim or expanded operands takes it, or a scalar
    tensor of another dtype). With it, whether the op is a list op off that route."""
    if name in NO_KERNEL_OPS or func.is_view:
        return 0, False
    if name.startswith(CONCATENATIONS):
        return _concat_launches(name, args, outputs), False
    if not name.startswith("aten._foreach_"):
        return (1 if outputs else 0), False
    route = _multi_tensor_route(args, name)
    if route is None:
        return 0, False
    return (1, False) if route else (len(_tensor_lists(args)[0]), True)


def _tensor_lists(args: tuple) -> list[list[torch.Tensor]]:
    return [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]


def _multi_tensor_route(args: tuple, name: str = "") -> bool | None:
    """For a ``torch._foreach_*`` op's ``args``: whether torch runs it as one multi-tensor
    kernel (:func:`_kernel_launches`), or None where it launches nothing (CPU lists)."""
    lists = _tensor_lists(args)
    tensors = [t for tensor_list in lists for t in _tensors(tensor_list)]
    if not tensors or all(t.device.type == "cpu" for t in tensors):
        return None
    if name.startswith(POINTWISE_0DIM_OPS) and len(lists) == 3:
        # ``_foreach_addcmul_``/``addcdiv_`` with one operand list of 0-dim tensors of the
        # inputs' dtype: ``PointwiseOpScalar0dTensorFunctor``, one kernel (ForeachPointwiseOp.cu).
        zero_dim = [k for k in (1, 2) if all(t.dim() == 0 and t.dtype == lists[0][0].dtype for t in lists[k])]
        if zero_dim:
            scalars = lists[zero_dim[0]]
            lists = [lst for k, lst in enumerate(lists) if k != zero_dim[0]]
            tensors = [t for tensor_list in lists for t in _tensors(tensor_list)] + list(scalars)
    # A ``.Tensor`` overload's 0-dim scalar on the device must match (a CPU one is read as a number).
    scalar_tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 0 and a.device.type != "cpu"]
    operands = tensors + scalar_tensors
    # ``_foreach_copy_`` takes one kernel across dtypes (``foreach_tensor_copy_list_kernel_cuda_``):
    # one dtype per list suffices.
    same_dtype = (all(len({t.dtype for t in lst}) == 1 for lst in lists) if name.startswith(CROSS_DTYPE_LIST_OPS)
                  else len({t.dtype for t in operands}) == 1)
    return (same_dtype and len({t.device for t in operands}) == 1
            and all(non_overlapping_and_dense(t) for t in tensors if t.dim())
            and all(len({_layout_key(t) for t in entry}) == 1 for entry in zip(*lists)))


def _layout_key(tensor: torch.Tensor) -> tuple:
    """Sizes and the strides torch's fast route compares: those of dims longer than 1 (a size-1
    dim's stride is never used, and ``ForeachUtils.h`` ignores it)."""
    return tuple(tensor.shape), tuple(st for size, st in zip(tensor.shape, tensor.stride()) if size > 1)


def _concat_launches(name: str, args: tuple, outputs: list[torch.Tensor]) -> int:
    """CUDA's ``cat`` runs one kernel when its inputs share the output's dtype, and
    ``_chunk_cat`` also when it widens bf16 to fp32; otherwise both copy each input on
    its own (``cat_out``: one ``copy_`` per input), one launch each."""
    if not outputs:
        return 0
    inputs = [t for t in _tensors(args[0]) if t.numel()]
    out_dtype = outputs[0].dtype
    dtypes = {t.dtype for t in inputs}
    if dtypes <= {out_dtype} or (name.startswith("aten._chunk_cat") and dtypes == {torch.bfloat16}
                                 and out_dtype == torch.float32):
        return 1
    return max(len(inputs), 1)


def _host_divisor_hazard(name: str, args: tuple, kwargs: dict) -> str | None:
    """How a true division on the device takes a host divisor (a Python number, or a 0-dim
    CPU tensor), which CUDA computes as ``a * (1 / b)``, an ulp off the CPU's quotient for
    some values (``BinaryDivTrueKernel.cu``; pytorch #186618); None otherwise, or for an
    integer-rounding division (``rounding_mode``), which divides."""
    if not name.startswith(TRUE_DIVISIONS) or kwargs.get("rounding_mode") is not None or len(args) < 2:
        return None
    dividend, divisor = args[0], args[1]
    if not isinstance(dividend, torch.Tensor) or not dividend.is_floating_point():
        return None
    if isinstance(divisor, (int, float)) or (isinstance(divisor, torch.Tensor) and divisor.dim() == 0
                                             and divisor.device.type == "cpu"):
        return "divides by a host number (CUDA multiplies by its reciprocal: other bits than the CPU's)"
    return None


def _scalar_precision_hazard(args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> str | None:
    """How an op reads a 0-dim device scalar of another floating dtype than its bf16 or
    fp16 tensors (CUDA casts it to theirs), or None. ``tensors``: every tensor it was given."""
    narrow = {t.dtype for t in tensors if t.ndim > 0 and t.dtype in REDUCED_FLOATS}
    if not narrow:
        return None
    direct = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    other = {t.dtype for t in direct if t.ndim == 0 and t.device.type != "cpu" and t.is_floating_point()} - narrow
    if not other:
        return None
    return f"reads a {_names(other)} device scalar as {_names(narrow)}"


def _names(dtypes: set[torch.dtype]) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def _scalars(tree: Any) -> tuple:
    """The host values in an op's arguments, in order: numbers, bools, strings, dtypes and
    the values of real 0-dim CPU tensors (a fake or device tensor's value is no host
    value; a process group is named by its tensors' collective, not compared)."""
    if isinstance(tree, DTensor):
        tree = tree.to_local()
    if isinstance(tree, torch.Tensor):
        if tree.device.type == "cpu" and tree.ndim == 0 and not isinstance(tree, FakeTensor):
            return (tree.item(),)
        return ()
    if isinstance(tree, (bool, int, float, str, torch.dtype)) or tree is None:
        return (tree,)
    if isinstance(tree, (list, tuple)):
        return tuple(v for item in tree for v in _scalars(item))
    if isinstance(tree, dict):
        return tuple(v for key, item in tree.items() for v in (key, *_scalars(item)))
    return ()


def first_scalar_changes(programs: list[list[tuple]], scalars: list[list[tuple]], limit: int = 5) -> list[str]:
    """Where steps with the same program launch it with other host values (the first
    ``limit``, as ``op: values -> values``); empty if none do (or the programs differ)."""
    if any(p != programs[0] for p in programs) or not scalars:
        return []
    found = []
    for index, op in enumerate(programs[0]):
        values = [step[index] for step in scalars]
        if any(v != values[0] for v in values):
            found.append(f"{op[0]}: " + " -> ".join(map(str, values)))
            if len(found) == limit:
                break
    return found


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts (a DTensor as its local tensor)."""
    if isinstance(tree, DTensor):
        return [tree.to_local()]
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _copy_ends(name: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, str] | None:
    """``(source, target device type)`` of a copy that names its target (``_to_copy``/``to``
    with a ``device``, ``copy_``), or None."""
    if name.startswith("aten._to_copy") or name.startswith("aten.to."):
        device = kwargs.get("device")
        return None if device is None else (args[0], torch.device(device).type)
    if name.startswith("aten.copy_"):
        return args[1], args[0].device.type
    return None


def _reads_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """A copy from the device into CPU memory: the host waits for it."""
    ends = _copy_ends(name, args, kwargs)
    return ends is not None and ends[1] == "cpu" and ends[0].device.type != "cpu"


def _data_dependent(func, args: tuple) -> bool:  # noqa: ANN001
    """An op whose result the host must wait for: a value it returns to Python, or an
    output shape that depends on device values (``nonzero``; indexing with a mask, but
    not with integer indices, whose shape is known)."""
    if torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func.name().startswith("aten::index"):
        return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:]))
    return True


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    return tensor.untyped_storage()


def _storage_id(tensor: torch.Tensor) -> int:
    return id(_storage(tensor))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _caller() -> str:
    """The innermost line of code outside torch and this module: where a sync came from."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in _OWN_FILES):
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "?"
