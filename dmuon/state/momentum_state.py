"""Muon's momentum state in the form its group asks for (``momentum_dtype``): made at a
parameter's first grad, read and stored back by each step, converted on a resume.

The forms (``dmuon.numerics.momentum_storage``):

- ``None``: ``momentum_buffer`` in the parameter's dtype, updated in place (as before);
- ``"bfloat16"``: a bf16 ``momentum_buffer``;
- ``"int8"``: int8 values ``momentum_int8`` and their fp32 ``momentum_scales`` (one per
  block of 128 elements of a row). A DTensor parameter's are DTensors with its placements,
  so DCP reshards them as it reshards the parameter. Where a layout cuts a row off the
  blocks (``dmuon.plan.momentum_blocks``), that parameter's momentum is kept in bf16
  instead, with one log line.

Why int8 values have a key of their own: DCP loads a checkpoint into the state the optimizer
has (its keys, dtypes and shapes). Between the float forms a load casts, which is the
conversion itself (fp32 to bf16 rounds to nearest even; bf16 to fp32 is exact). Under one key
int8 values would be cast into a float buffer without their scales, silently wrong; under their
own key such a load fails, naming the missing key. A plain ``load_state_dict`` gets the saved
tensors themselves, and converts any form to any (:func:`convert_loaded`).

A step reads each momentum as a tensor of the parameter's dtype (:class:`MomentumReads`), runs the
momentum rule on it, and rounds the result into the store under the step's masks. The fast path
does so a few blocks at a time, as the owner exchange packs them (``dmuon.step.fast_path``), so a
low-precision momentum does not raise the step's peak. Nothing of a read outlives its step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dmuon.numerics.momentum_storage import (
    INT8_MIN_ROW,
    MomentumCopies,
    bytes_per_element,
    parse_momentum_dtype,
    read_momenta,
    row_length,
    scales_shape,
    store_momenta_,
)
from dmuon.numerics.update_rules import bounded_chunks
from dmuon.plan.momentum_blocks import int8_blocks_whole
from dmuon.plan.paths import layout_of
from dmuon.torch_compat import dtensor_where_it_is, local_of

logger = logging.getLogger("dmuon")

BUFFER_KEY = "momentum_buffer"  # the momentum in a float dtype: the parameter's, or bf16
INT8_KEY = "momentum_int8"  # int8 momentum's values (module docstring: why not ``momentum_buffer``)
SCALES_KEY = "momentum_scales"  # int8 momentum's fp32 scales


def kept_momentum(state: Mapping[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A parameter's kept momentum, values and int8 scales (None in the float forms), or None
    before its first grad."""
    if not state:
        return None
    if INT8_KEY in state:
        return state[INT8_KEY], state[SCALES_KEY]
    return (state[BUFFER_KEY], None) if BUFFER_KEY in state else None


def storage_of(param: torch.Tensor, momentum_dtype: str | None) -> str | None:
    """The form ``param``'s momentum is kept in: the group's ``momentum_dtype``, but bf16 for
    int8 where :func:`int8_falls_back` (decided from the global shape and placements: the same
    on every rank)."""
    return "bfloat16" if momentum_dtype == "int8" and int8_falls_back(param) is not None else momentum_dtype


def int8_falls_back(param: torch.Tensor) -> str | None:
    """Why ``param``'s int8 momentum is kept in bf16 (:func:`storage_of`), in words; None
    where it is not."""
    if row_length(param.shape) < INT8_MIN_ROW:
        return (f"its rows of {row_length(param.shape)} element(s) would cost {bytes_per_element(param.shape, 'int8')}"
                " bytes an element in int8 with their scales")
    if isinstance(param, DTensor) and not int8_blocks_whole(layout_of(param), param.shape):
        return f"its placements {tuple(param.placements)} cut its rows off int8's 128-element blocks"
    return None


def new_momentum(param: torch.Tensor, storage: str | None) -> dict[str, torch.Tensor]:
    """Zero momentum state of ``param`` in the form ``storage`` (:func:`storage_of`)."""
    if storage is None:
        return {BUFFER_KEY: torch.zeros_like(param, memory_format=torch.preserve_format)}
    if storage == "bfloat16":
        return {BUFFER_KEY: torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.preserve_format)}
    values = torch.zeros_like(param, dtype=torch.int8, memory_format=torch.contiguous_format)
    local = local_of(param)
    scales = torch.zeros(scales_shape(local.shape), dtype=torch.float32, device=local.device)
    if isinstance(param, DTensor):  # the parameter's placements, on a global shape of scales
        scales = dtensor_where_it_is(scales, param.device_mesh, param.placements, scales_shape(param.shape))
    return {INT8_KEY: values, SCALES_KEY: scales}


def make_momentum(param: torch.Tensor, momentum_dtype: str | None, state: MutableMapping[str, Any],
                  name: str) -> list[str]:
    """Put ``param``'s zero momentum into its ``state`` (at its first grad); the keys made."""
    storage = storage_of(param, momentum_dtype)
    if storage != momentum_dtype:
        logger.info("DMuon: parameter %r keeps its momentum in bfloat16, not int8: %s (docs/optimizer.md, "
                    "\"Momentum dtype\")", name, int8_falls_back(param))
    made = new_momentum(param, storage)
    state.update(made)
    return list(made)


READ_CHUNK_NUMEL = 1 << 24
"""Elements of momenta kept in another dtype that a step reads at once off the fast path
(:func:`read_chunks`): their parameter-dtype copies hold at most this many (64 MiB in fp32),
the bound the fast path's pack chunk keeps (``dmuon.plan.pack_layout.PACK_CHUNK_NUMEL``)."""


def read_chunks(states: Sequence[Mapping[str, Any] | None], likes: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of the parameters (their ``states``, local tensors ``likes``) whose momenta a
    step reads, updates and stores together: all at once where every kept momentum is its own
    working tensor (nothing is read: the rules run as one list op per group), else chunks of at
    most :data:`READ_CHUNK_NUMEL` elements (a larger tensor alone), so a low-precision momentum
    never has parameter-dtype copies of more than one chunk alive."""
    kept = [kept_momentum(state) for state in states]  # None, or read as itself: held in ``like``'s dtype
    if all(m is None or (m[1] is None and m[0].dtype == like.dtype) for m, like in zip(kept, likes)):
        return [list(range(len(likes)))] if likes else []
    return bounded_chunks([like.numel() for like in likes], READ_CHUNK_NUMEL)


class MomentumReads:
    """One step's momenta of some parameters, read as tensors of the parameters' dtypes to run
    the rule on (:meth:`read`), then rounded back into their stores (:meth:`store`)."""

    def __init__(self) -> None:
        self._reads: list[tuple[list[torch.Tensor], list[torch.Tensor | None], MomentumCopies,
                                list[torch.Tensor] | None]] = []

    def read(self, states: Sequence[Mapping[str, Any] | None], likes: Sequence[torch.Tensor],
             oks: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The momentum of each parameter whose local tensor (or stand-in) is the ``likes`` entry,
        from its ``states`` entry: its store itself where that is in the local tensor's dtype,
        else a new tensor that :meth:`store` rounds back where the 0-dim device bool ``oks`` entry
        holds (None: always); zeros where there is no state yet (nothing is made or stored)."""
        working: list[torch.Tensor] = [None] * len(likes)  # type: ignore[list-item]
        kept, values, scales = [], [], []
        for i, (state, like) in enumerate(zip(states, likes)):
            momentum = kept_momentum(state)
            if momentum is None:
                working[i] = torch.zeros_like(like)
                continue
            kept.append(i)
            values.append(local_of(momentum[0]))
            scales.append(None if momentum[1] is None else local_of(momentum[1]))
        read = self.read_kept(values, scales, [likes[i].dtype for i in kept],
                              None if oks is None else [oks[i] for i in kept])
        for i, work in zip(kept, read):
            working[i] = work
        return working

    def read_kept(self, values: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None],
                  dtypes: Sequence[torch.dtype], oks: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """:meth:`read` of kept momenta given as their local tensors (values, and int8 scales
        or None), or views of them (the fast path reads a few blocks of rows at a time), each
        as a tensor of its ``dtypes`` entry."""
        copies = read_momenta(values, scales, dtypes)
        self._reads.append((list(values), list(scales), copies, None if oks is None else list(oks)))
        return copies.working

    def store(self, foreach: bool = False) -> None:
        """Round every momentum read into its store (masked where it was read with ``oks``)."""
        for values, scales, copies, oks in self._reads:
            store_momenta_(values, scales, copies, oks, foreach)
        self._reads.clear()


class MomentumDtypes:
    """Each group's ``momentum_dtype`` as the state was last made, loaded or converted for. A
    group edited between steps (``opt.param_groups[i]["momentum_dtype"] = "int8"``) is checked
    at the next step (:meth:`check`): refused by name if it is not a form, else its momenta are
    converted as a resume converts them, with one log line (issue 60, item 6)."""

    def __init__(self) -> None:
        self._held: list[Any] | None = None  # None: not yet seen (a new optimizer, or a copy)

    def settle(self, param_groups: Sequence[dict[str, Any]]) -> None:
        """The groups' values are what the state is held for (after a load's conversion)."""
        self._held = [g.get("momentum_dtype") for g in param_groups]

    def check(self, param_groups: Sequence[dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]],
              name_of: Callable[[torch.Tensor], str]) -> None:
        """Before a step (nothing changed yet, no collective: every rank edits alike and raises
        alike): a changed ``momentum_dtype`` parsed, ValueError naming the group otherwise, and
        every momentum held in another form than its group's converted."""
        values = [g.get("momentum_dtype") for g in param_groups]
        if self._held is not None and len(values) == len(self._held) and all(
                a is b or (type(a) is type(b) and a == b) for a, b in zip(values, self._held)):
            return  # the usual step: a list compare
        for i, group in enumerate(param_groups):
            if group["use_muon"]:
                try:
                    group["momentum_dtype"] = parse_momentum_dtype(group["momentum_dtype"])
                except ValueError as error:
                    names = ", ".join(name_of(p) for p in group["params"][:3])
                    raise ValueError(f"DMuon: param_groups[{i}] ({names}), edited after construction: {error}. "
                                     "Set one of them before the next step") from None
        convert_loaded(param_groups, state, name_of, when="after param_groups changed")
        self.settle(param_groups)


def convert_loaded(param_groups: Sequence[dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]],
                   name_of: Callable[[torch.Tensor], str], when: str = "on resume") -> None:
    """After a load (or an edit of a group's ``momentum_dtype``, ``when``): each Muon momentum
    kept in another form than its group's ``momentum_dtype`` asks for converted to it, read as
    the parameter's dtype and rounded once into the new form; one log line per form."""
    converted: dict[tuple[str, str], list[str]] = {}
    for group in (g for g in param_groups if g["use_muon"]):
        for param in group["params"]:
            entry = state.get(param, {})
            if (momentum := kept_momentum(entry)) is None:
                continue
            values, scales = momentum
            target = storage_of(param, group["momentum_dtype"])
            held = torch.int8 if scales is not None else values.dtype  # the dtype it is held in, int8 with scales
            wanted = {None: param.dtype, "bfloat16": torch.bfloat16, "int8": torch.int8}[target]
            if held == wanted:
                continue
            (working,) = read_momenta([local_of(values)], [None if scales is None else local_of(scales)],
                                      [local_of(param).dtype]).working
            made = new_momentum(param, target)
            int8 = INT8_KEY in made
            store_momenta_([local_of(made[INT8_KEY if int8 else BUFFER_KEY])],
                           [local_of(made[SCALES_KEY]) if int8 else None], MomentumCopies([working], alone=[0]))
            for key in (BUFFER_KEY, INT8_KEY, SCALES_KEY):
                entry.pop(key, None)
            entry.update(made)
            key = (str(held).removeprefix("torch."), str(wanted).removeprefix("torch."))
            converted.setdefault(key, []).append(name_of(param))
    for (old, new), names in converted.items():
        logger.info("DMuon: momentum converted %s from %s to %s: %s", when, old, new, ", ".join(names))
