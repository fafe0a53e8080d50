"""State kept between steps in the form its group asks for: Muon's momentum (``momentum_dtype``)
and the AdamW part's two moments (``adamw_state_dtype``, a group's ``state_dtype``), made at a
parameter's first grad, read and stored back by each step, converted on a resume.

The forms (``dmuon.numerics.momentum_storage``):

- ``None``: a buffer in the parameter's dtype, updated in place (as before);
- ``"bfloat16"``: a bf16 buffer;
- ``"int8"``: int8 values and their fp32 scales (one per block of 128 elements of a row). A
  DTensor parameter's are DTensors with its placements, so DCP reshards them as it reshards the
  parameter. Where a layout cuts a row off the blocks (``dmuon.plan.momentum_blocks``), or a row
  is narrower than ``INT8_MIN_ROW``, that state is kept in bf16 instead, with one log line.
  AdamW's ``exp_avg_sq`` keeps the int8 form of its square root (:data:`EXP_AVG_SQ`: docs/
  optimizer.md, "AdamW state dtype", has the measurement that chose it).

The AdamW part keeps the moments of a parameter with fewer than 2 dims (norms, biases) in its
dtype whatever its group asks (:func:`adamw_wanted`): they hold a few thousand elements.

Why int8 values have keys of their own: DCP loads a checkpoint into the state the optimizer
has (its keys, dtypes and shapes). Between the float forms a load casts, which is the
conversion itself (fp32 to bf16 rounds to nearest even; bf16 to fp32 is exact). Under one key
int8 values would be cast into a float buffer without their scales, silently wrong; under their
own key such a load fails, naming the missing key. A plain ``load_state_dict`` gets the saved
tensors themselves, and converts any form to any (:func:`convert_loaded`).

A step reads each kept state as a tensor of the parameter's dtype (:class:`MomentumReads`), runs
its rule on it, and rounds the result into the store under the step's masks, a chunk of
parameters at a time (:func:`read_chunks`; the fast path: a few blocks at a time, as the owner
exchange packs them, ``dmuon.step.fast_path``; the AdamW part on the CPU: rows of one parameter,
:func:`step_pieces`), so a low-precision state does not raise the step's peak. Nothing of a read
outlives its step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
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

@dataclass(frozen=True)
class StateKeys:
    """Where one kept state lives in a parameter's state dict, in each form."""

    buffer: str  # in a float dtype: the parameter's, or bf16
    int8: str  # int8 values (module docstring: why a key of their own)
    scales: str  # their fp32 scales
    what: str  # its name in log lines
    root: bool = False  # int8 keeps the square root (a non-negative value spanning many magnitudes)

    @property
    def keys(self) -> tuple[str, str, str]:
        return self.buffer, self.int8, self.scales


MOMENTUM = StateKeys("momentum_buffer", "momentum_int8", "momentum_scales", "momentum")
EXP_AVG = StateKeys("exp_avg", "exp_avg_int8", "exp_avg_scales", "AdamW moments")
EXP_AVG_SQ = StateKeys("exp_avg_sq", "exp_avg_sq_root_int8", "exp_avg_sq_root_scales", "AdamW moments", root=True)
ADAMW_MOMENTS = (EXP_AVG, EXP_AVG_SQ)


def kept_momentum(state: Mapping[str, Any] | None,
                  keys: StateKeys = MOMENTUM) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A parameter's kept state at ``keys`` (its momentum, or one AdamW moment), values and int8
    scales (None in the float forms), or None before its first grad."""
    if not state:
        return None
    if keys.int8 in state:
        return state[keys.int8], state[keys.scales]
    return (state[keys.buffer], None) if keys.buffer in state else None


def storage_of(param: torch.Tensor, momentum_dtype: str | None) -> str | None:
    """The form ``param``'s momentum is kept in: the group's ``momentum_dtype``, but bf16 for
    int8 where :func:`int8_falls_back` (decided from the global shape and placements: the same
    on every rank)."""
    return "bfloat16" if momentum_dtype == "int8" and int8_falls_back(param) is not None else momentum_dtype


def adamw_wanted(param: torch.Tensor, state_dtype: str | None) -> str | None:
    """The form an AdamW group's ``state_dtype`` asks for ``param``'s moments: itself for a
    parameter of 2 or more dims, the parameter's dtype for a smaller one (a norm, a bias: too
    few elements to pay); int8's fallback then applies (:func:`storage_of`)."""
    return state_dtype if param.ndim >= 2 else None


def int8_falls_back(param: torch.Tensor) -> str | None:
    """Why ``param``'s int8 momentum is kept in bf16 (:func:`storage_of`), in words; None
    where it is not."""
    if row_length(param.shape) < INT8_MIN_ROW:
        return (f"its rows of {row_length(param.shape)} element(s) would cost {bytes_per_element(param.shape, 'int8')}"
                " bytes an element in int8 with their scales")
    if isinstance(param, DTensor) and not int8_blocks_whole(layout_of(param), param.shape):
        return f"its placements {tuple(param.placements)} cut its rows off int8's 128-element blocks"
    return None


def new_momentum(param: torch.Tensor, storage: str | None, keys: StateKeys = MOMENTUM) -> dict[str, torch.Tensor]:
    """Zero state of ``param`` at ``keys`` in the form ``storage`` (:func:`storage_of`)."""
    if storage is None:
        return {keys.buffer: torch.zeros_like(param, memory_format=torch.preserve_format)}
    if storage == "bfloat16":
        return {keys.buffer: torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.preserve_format)}
    values = torch.zeros_like(param, dtype=torch.int8, memory_format=torch.contiguous_format)
    local = local_of(param)
    scales = torch.zeros(scales_shape(local.shape), dtype=torch.float32, device=local.device)
    if isinstance(param, DTensor):  # the parameter's placements, on a global shape of scales
        scales = dtensor_where_it_is(scales, param.device_mesh, param.placements, scales_shape(param.shape))
    return {keys.int8: values, keys.scales: scales}


def make_momentum(param: torch.Tensor, wanted: str | None, state: MutableMapping[str, Any], name: str,
                  all_keys: Sequence[StateKeys] = (MOMENTUM,)) -> list[str]:
    """Put ``param``'s zero state at each of ``all_keys`` into its ``state`` (at its first grad),
    in the form ``wanted`` (int8's fallback: :func:`storage_of`); the keys made."""
    storage = storage_of(param, wanted)
    if storage != wanted:
        logger.info("DMuon: parameter %r keeps its %s in bfloat16, not int8: %s (docs/optimizer.md, "
                    "\"Momentum dtype\")", name, all_keys[0].what, int8_falls_back(param))
    made = {key: value for keys in all_keys for key, value in new_momentum(param, storage, keys).items()}
    state.update(made)
    return list(made)


READ_CHUNK_NUMEL = 1 << 24
"""Elements of momenta kept in another dtype that a step reads at once off the fast path
(:func:`read_chunks`): their parameter-dtype copies hold at most this many (64 MiB in fp32),
the bound the fast path's pack chunk keeps (``dmuon.plan.pack_layout.PACK_CHUNK_NUMEL``)."""


def read_chunks(states: Sequence[Mapping[str, Any] | None], likes: Sequence[torch.Tensor],
                all_keys: Sequence[StateKeys] = (MOMENTUM,)) -> list[list[int]]:
    """Indices of the parameters (their ``states``, local tensors ``likes``) whose momenta a
    step reads, updates and stores together: all at once where every kept momentum is its own
    working tensor (nothing is read: the rules run as one list op per group), else chunks of at
    most :data:`READ_CHUNK_NUMEL` elements (a larger tensor alone), so a low-precision momentum
    never has parameter-dtype copies of more than one chunk alive."""
    if all(read_as_itself(kept_momentum(state, keys), like) for state, like in zip(states, likes) for keys in all_keys):
        return [list(range(len(likes)))] if likes else []
    return bounded_chunks([like.numel() for like in likes], READ_CHUNK_NUMEL)


def read_as_itself(momentum: tuple[torch.Tensor, torch.Tensor | None] | None, like: torch.Tensor) -> bool:
    """Whether a kept state (:func:`kept_momentum`'s, of the parameter whose local tensor is
    ``like``) needs no read: none yet, or held in ``like``'s dtype (the rule updates it in place)."""
    return momentum is None or (momentum[1] is None and momentum[0].dtype == like.dtype)


CPU_PIECE_NUMEL = 1 << 19
"""Elements of one parameter kept in another form that the AdamW part steps at once on the CPU
(:func:`step_pieces`): its reads, torch's AdamW and the stores then make copies of 2 MiB that stay
in the cache and are reused by the allocator, where copies of a whole embedding (above glibc's 32
MiB mmap limit) were faulted in afresh each step and went through main memory about ten times:
int8 moments took 3.4x the fp32 moments' step time whole, 1.2x in pieces (``benchmarks/
adamw_state_time.py``, docs/optimizer.md). Smaller pieces pay more in per-op overhead than they
save. Not elsewhere: a GPU kernel wants the whole tensor."""


@dataclass(frozen=True)
class Piece:
    """What a step reads, updates and stores together: parameters ``index`` whole (``rows``
    None), or the rows ``rows`` of the one parameter ``index[0]`` (:func:`rows_of`)."""

    index: list[int]
    rows: slice | None = None


def step_pieces(states: Sequence[Mapping[str, Any] | None], likes: Sequence[torch.Tensor],
                all_keys: Sequence[StateKeys], cuttable: Sequence[bool]) -> list[Piece]:
    """:func:`read_chunks` as :class:`Piece` s, where each parameter on the CPU that keeps a state
    in another form and is ``cuttable`` (its local tensors contiguous, not empty) is cut into
    rows of at most :data:`CPU_PIECE_NUMEL` elements (one row where a row is longer). Rows, not
    elements: an int8 block and its scale never straddle two pieces."""
    pieces = []
    for chunk in read_chunks(states, likes, all_keys):
        cut = [i for i in chunk if cuttable[i] and likes[i].device.type == "cpu" and likes[i].numel()
               and not all(read_as_itself(kept_momentum(states[i], keys), likes[i]) for keys in all_keys)]
        if whole := [i for i in chunk if i not in cut]:
            pieces.append(Piece(whole))
        for i in cut:
            width = row_length(likes[i].shape)
            per_piece = max(1, CPU_PIECE_NUMEL // width)
            # whole vectors of torch's fused CPU kernel in each piece but the last (its tail
            # elements compute otherwise): 64 rows hold a multiple of 64 elements
            per_piece -= per_piece % 64 if per_piece >= 64 else 0
            rows = likes[i].numel() // width
            pieces += [Piece([i], slice(r, min(r + per_piece, rows))) for r in range(0, rows, per_piece)]
    return pieces


def rows_of(tensor: torch.Tensor, rows: slice, width: int | None = None) -> torch.Tensor:
    """The rows ``rows`` of a contiguous ``tensor``, as the blocks of int8 run along them
    (``dmuon.numerics.momentum_storage.row_length``; ``width``: elements a row, for int8 scales),
    a view."""
    return tensor.view(-1, width or row_length(tensor.shape))[rows]


def state_rows(state: Mapping[str, Any], rows: slice, all_keys: Sequence[StateKeys]) -> dict[str, torch.Tensor]:
    """The rows ``rows`` of each state at ``all_keys`` (local views: values, and int8's scales),
    as a state a step reads and stores through."""
    piece = {}
    for keys in all_keys:
        if (kept := kept_momentum(state, keys)) is None:
            continue
        values, scales = (None if t is None else local_of(t) for t in kept)
        piece[keys.buffer if scales is None else keys.int8] = rows_of(values, rows)
        if scales is not None:
            piece[keys.scales] = rows_of(scales, rows, scales.shape[-1])
    return piece


class MomentumReads:
    """One step's momenta of some parameters, read as tensors of the parameters' dtypes to run
    the rule on (:meth:`read`), then rounded back into their stores (:meth:`store`)."""

    def __init__(self) -> None:
        self._reads: list[tuple[list[torch.Tensor], list[torch.Tensor | None], MomentumCopies,
                                list[torch.Tensor] | None, bool]] = []

    def read(self, states: Sequence[Mapping[str, Any] | None], likes: Sequence[torch.Tensor],
             oks: Sequence[torch.Tensor] | None = None, keys: StateKeys = MOMENTUM) -> list[torch.Tensor]:
        """The state at ``keys`` of each parameter whose local tensor (or stand-in) is the ``likes``
        entry, from its ``states`` entry: its store itself where that is in the local tensor's dtype,
        else a new tensor that :meth:`store` rounds back where the 0-dim device bool ``oks`` entry
        holds (None: always); zeros where there is no state yet (nothing is made or stored)."""
        working: list[torch.Tensor] = [None] * len(likes)  # type: ignore[list-item]
        kept, values, scales = [], [], []
        for i, (state, like) in enumerate(zip(states, likes)):
            momentum = kept_momentum(state, keys)
            if momentum is None:
                working[i] = torch.zeros_like(like)
                continue
            kept.append(i)
            values.append(local_of(momentum[0]))
            scales.append(None if momentum[1] is None else local_of(momentum[1]))
        read = self.read_kept(values, scales, [likes[i].dtype for i in kept],
                              None if oks is None else [oks[i] for i in kept], keys.root)
        for i, work in zip(kept, read):
            working[i] = work
        return working

    def read_kept(self, values: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None],
                  dtypes: Sequence[torch.dtype], oks: Sequence[torch.Tensor] | None = None,
                  root: bool = False) -> list[torch.Tensor]:
        """:meth:`read` of kept momenta given as their local tensors (values, and int8 scales
        or None), or views of them (the fast path reads a few blocks of rows at a time), each
        as a tensor of its ``dtypes`` entry; with ``root``, int8 holds square roots (squared
        here, and their roots stored)."""
        copies = read_momenta(values, scales, dtypes)
        if root and (roots := _int8_working(copies, scales)):
            torch._foreach_mul_(roots, roots)
        self._reads.append((list(values), list(scales), copies, None if oks is None else list(oks), root))
        return copies.working

    def store(self, foreach: bool = False) -> None:
        """Round every momentum read into its store (masked where it was read with ``oks``)."""
        for values, scales, copies, oks, root in self._reads:
            if root and (roots := _int8_working(copies, scales)):
                torch._foreach_sqrt_(roots)
            store_momenta_(values, scales, copies, oks, foreach)
        self._reads.clear()


def _int8_working(copies: MomentumCopies, scales: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The working tensors read from int8 (new tensors: squared and rooted in place)."""
    return [work for work, scale in zip(copies.working, scales) if scale is not None]


def dtype_key(group: Mapping[str, Any]) -> str:
    """The key of a group's kept-state form: a Muon group's ``momentum_dtype``, an AdamW
    group's ``state_dtype``."""
    return "momentum_dtype" if group["use_muon"] else "state_dtype"


class MomentumDtypes:
    """Each group's form (:func:`dtype_key`) as the state was last made, loaded or converted for.
    A group edited between steps (``opt.param_groups[i]["momentum_dtype"] = "int8"``) is checked
    at the next step (:meth:`check`): refused by name if it is not a form, else its state is
    converted as a resume converts it, with one log line (issue 60, item 6)."""

    def __init__(self) -> None:
        self._held: list[Any] | None = None  # None: not yet seen (a new optimizer, or a copy)

    def settle(self, param_groups: Sequence[dict[str, Any]]) -> None:
        """The groups' values are what the state is held for (after a load's conversion)."""
        self._held = [g.get(dtype_key(g)) for g in param_groups]

    def check(self, param_groups: Sequence[dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]],
              name_of: Callable[[torch.Tensor], str]) -> None:
        """Before a step (nothing changed yet, no collective: every rank edits alike and raises
        alike): a changed form parsed, ValueError naming the group otherwise, and every state
        held in another form than its group's converted."""
        values = [g.get(dtype_key(g)) for g in param_groups]
        if self._held is not None and len(values) == len(self._held) and all(
                a is b or (type(a) is type(b) and a == b) for a, b in zip(values, self._held)):
            return  # the usual step: a list compare
        for i, group in enumerate(param_groups):
            if dtype_key(group) in group:
                try:
                    group[dtype_key(group)] = parse_momentum_dtype(group[dtype_key(group)], dtype_key(group))
                except ValueError as error:
                    names = ", ".join(name_of(p) for p in group["params"][:3])
                    raise ValueError(f"DMuon: param_groups[{i}] ({names}), edited after construction: {error}. "
                                     "Set one of them before the next step") from None
        convert_loaded(param_groups, state, name_of, when="after param_groups changed")
        self.settle(param_groups)


def kept_forms(group: Mapping[str, Any], param: torch.Tensor) -> list[tuple[StateKeys, str | None]]:
    """Each state ``param`` keeps in its ``group`` with the form it is kept in: a Muon group's
    momentum, an AdamW group's two moments."""
    if group["use_muon"]:
        return [(MOMENTUM, storage_of(param, group["momentum_dtype"]))]
    return [(keys, storage_of(param, adamw_wanted(param, group.get("state_dtype")))) for keys in ADAMW_MOMENTS]


def convert_loaded(param_groups: Sequence[dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]],
                   name_of: Callable[[torch.Tensor], str], when: str = "on resume") -> None:
    """After a load (or an edit of a group's form, ``when``): each kept state held in another
    form than its group asks for (:func:`kept_forms`) converted to it, read as the parameter's
    dtype and rounded once into the new form; one log line per form."""
    converted: dict[tuple[str, str, str], list[str]] = {}
    for group in param_groups:
        for param in group["params"]:
            entry = state.get(param, {})
            for keys, target in kept_forms(group, param):
                if (momentum := kept_momentum(entry, keys)) is None:
                    continue
                held = torch.int8 if momentum[1] is not None else momentum[0].dtype  # int8 with scales
                wanted = {None: param.dtype, "bfloat16": torch.bfloat16, "int8": torch.int8}[target]
                if held == wanted:
                    continue
                local = local_of(param)
                (working,) = MomentumReads().read([entry], [local], keys=keys)
                for key in keys.keys:
                    entry.pop(key, None)
                entry.update(new_momentum(param, target, keys))
                writes = MomentumReads()
                writes.read([entry], [local], keys=keys)[0].copy_(working)
                writes.store()
                key = (keys.what, str(held).removeprefix("torch."), str(wanted).removeprefix("torch."))
                converted.setdefault(key, []).append(name_of(param))
    for (what, old, new), names in converted.items():
        logger.info("DMuon: %s converted %s from %s to %s: %s", what, when, old, new, ", ".join(dict.fromkeys(names)))
