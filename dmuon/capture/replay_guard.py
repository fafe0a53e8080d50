"""What a captured step's graph reads, held and checked before each replay
(``dmuon.capture.cuda_graphs``).

A CUDA graph replays its kernels on the memory addresses it was captured with; no host code of
``step()`` runs. Every tensor it reads must therefore still be the one captured, at the same
place, and must not have been freed: the caching allocator hands a freed block to the next
request (activations, say), and a replay would then read and write that memory silently.
Python's ``id()`` is no such check: a grad made after ``zero_grad(set_to_none=True)`` often
gets the freed grad's ``id``.

:class:`ReplayGuard` therefore holds a reference to every tensor the graph reads (the groups'
``lr`` and ``weight_decay`` tensors, each parameter, its grad and its state tensors) and the
step's long-lived buffers (``StepPhases.replay_buffers``), so none of them is freed while the
graph may replay, and compares each one's identity and storage address (``data_ptr``) before
each replay: a replaced or moved tensor raises, naming the parameter and the fix. The groups'
other options are compared by value, and so are the whole optimizer's (``dmuon.options.table``'s
whole-optimizer options and the optimizer's values of the flags that choose a path, ``foreach``,
``fused`` and ``capturable``), fixed in the graph too: a change raises, naming the option(s).

A number written to ``lr`` or ``weight_decay`` between replays (a scheduler that assigns
``group["lr"] = value``) is copied into the tensor the graph reads, on the device; the group
keeps that tensor."""

from __future__ import annotations

from collections.abc import Iterator
from numbers import Real
from typing import TYPE_CHECKING

import torch

from dmuon.options.device_hyperparameters import SCHEDULER_VALUES
from dmuon.options.implementation_flags import NO_PATH_KEYS
from dmuon.options.table import FLAG_KEYS, OPTIMIZER_OPTIONS
from dmuon.numerics.device_scalars import DEVICE_HYPERPARAMETERS
from dmuon.torch_compat import local_of

if TYPE_CHECKING:
    from dmuon.optimizer import DMuon

# Group keys a replay may see change: the device hyperparameters (read on the device) and what
# schedulers keep beside them.
_MAY_CHANGE = {"params", *DEVICE_HYPERPARAMETERS, *SCHEDULER_VALUES}
# The whole optimizer's options, each an attribute of the DMuon (telemetry: its phases').
_WHOLE = (*OPTIMIZER_OPTIONS, *(name for name in FLAG_KEYS if name not in NO_PATH_KEYS))
_RECAPTURE = "call release() and step() again to capture anew"
# What to do when a tensor of each kind was replaced.
_FIX = {
    "grad": "zero grads in place (zero_grad(set_to_none=False)) so the graph reads them where they are, or "
            + _RECAPTURE,
    "hyperparameter": "write a number (it is copied in) or fill_ the tensor in place, or " + _RECAPTURE,
    "parameter": _RECAPTURE,
    "state": "load_state_dict keeps a state tensor whose shape, dtype and placements are unchanged; otherwise "
             + _RECAPTURE,
}


def _storage(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else local_of(tensor).data_ptr()


def _read_tensors(optimizer: DMuon) -> Iterator[tuple[tuple, torch.Tensor | None]]:
    """(where, tensor) for each tensor the step reads, in a fixed order; ``where`` is a cheap
    key, ``(kind, group index, position in the group, state key)``, put into words
    (:func:`_what`) only for an error: a check walks about 1,200 tensors at llama3 8B, and
    making a label for each took two thirds of its time."""
    state = optimizer.state
    for index, group in enumerate(optimizer.param_groups):
        for key in DEVICE_HYPERPARAMETERS:
            yield ("hyperparameter", index, None, key), group[key]
        for position, param in enumerate(group["params"]):
            yield ("parameter", index, position, None), param
            yield ("grad", index, position, None), param.grad
            for key, value in state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    yield ("state", index, position, key), value


def _what(optimizer: DMuon, where: tuple) -> str:
    """The words for a :func:`_read_tensors` key."""
    kind, index, position, key = where
    if kind == "hyperparameter":
        return f"{key} of param group {index}"
    name = optimizer.param_name(optimizer.param_groups[index]["params"][position])
    return {"parameter": f"the parameter {name!r}", "grad": f"the grad of {name!r}",
            "state": f"the state {key!r} of {name!r}"}[kind]


def _options(optimizer: DMuon) -> list[tuple[tuple[str, str], ...]]:
    return [tuple(sorted((k, repr(v)) for k, v in group.items() if k not in _MAY_CHANGE))
            for group in optimizer.param_groups]


def _whole_options(optimizer: DMuon) -> dict[str, str]:
    return {name: repr(optimizer.phases.telemetry.enabled if name == "telemetry" else getattr(optimizer, name))
            for name in _WHOLE}


class ReplayGuard:
    """The tensors, buffers and options a graph of ``optimizer``'s step was captured with."""

    def __init__(self, optimizer: DMuon) -> None:
        self._optimizer = optimizer
        self._held = [(where, tensor, _storage(tensor)) for where, tensor in _read_tensors(optimizer)]
        self._buffers = optimizer.phases.replay_buffers()  # held: freed, a replay would read freed memory
        self._options = _options(optimizer)
        self._whole = _whole_options(optimizer)

    def check(self) -> None:
        """Raise, naming what and the fix, if a replay would not read what was captured; first
        copy numbers written to ``lr`` or ``weight_decay`` into the captured tensors."""
        self._copy_numbers_in()
        options = _options(self._optimizer)
        if len(options) != len(self._options):
            raise RuntimeError(f"dmuon.capture.cuda_graphs: param groups were added since the capture: {_RECAPTURE}")
        for index, (before, now) in enumerate(zip(self._options, options)):
            if before != now:
                changed = sorted({k for k, _ in set(before) ^ set(now)})
                raise RuntimeError(f"dmuon.capture.cuda_graphs: param group {index} changed since the capture (the "
                                   f"option(s) {changed}, fixed in the graph): {_RECAPTURE}")
        changed = [name for name, value in _whole_options(self._optimizer).items() if value != self._whole[name]]
        if changed:
            raise RuntimeError(f"dmuon.capture.cuda_graphs: the optimizer's option(s) {changed} changed since the "
                               f"capture (fixed in the graph): {_RECAPTURE}")
        now_read = list(_read_tensors(self._optimizer))
        for (where, tensor, storage), (where_now, tensor_now) in zip(self._held, now_read):
            if tensor_now is not tensor or where_now != where or _storage(tensor_now) != storage:
                what = _what(self._optimizer, where)
                raise RuntimeError(f"dmuon.capture.cuda_graphs: {what} was replaced since the capture (another tensor, "
                                   f"or its storage moved): the graph would replay on the one it captured; "
                                   f"{_FIX[where[0]]}")
        if len(now_read) != len(self._held):
            raise RuntimeError("dmuon.capture.cuda_graphs: parameters or state entries were added or removed since the "
                               f"capture: {_RECAPTURE}")

    def _copy_numbers_in(self) -> None:
        held = {where: tensor for where, tensor, _ in self._held if where[0] == "hyperparameter"}
        for index, group in enumerate(self._optimizer.param_groups):
            for key in DEVICE_HYPERPARAMETERS:
                value = group[key]
                tensor = held.get(("hyperparameter", index, None, key))
                if isinstance(value, Real) and not isinstance(value, bool) and tensor is not None:
                    tensor.fill_(float(value))  # a fill kernel on the current stream: no host sync
                    group[key] = tensor
