"""The shape sweep on one rank: run cases, record what happened, compare with one process.

``run_cases(case_ids, out_dir, check_timeout_s)`` runs on every rank of a launch
(``tests.multiprocess.run_on_ranks``). Per case (``tests.shape_cases`` names the fields)
each rank builds the model's full tensors from the seed, cuts its DTensors out of them
(``benchmarks.layouts.as_dtensor``), steps DMuon :data:`STEPS` times on seeded grads (the
same full grad on every rank, cut like the parameter) and records, as one JSON line in
``out_dir/rank<r>.jsonl`` (the driver, ``tests.shape_sweep``, judges):

- ``errors``: per phase, what raised on this rank (check a);
- ``differ``: weights and optimizer state (every key, momentum values and int8 scales
  included, the AdamW part's moments in the case's ``adamw_state_dtype`` too, gathered whole)
  that are not bitwise those of single-process DMuon stepped on the full plain tensors with
  the same options (check b). A parameter whose layout cuts its int8 rows off the 128-element
  blocks keeps its momentum (or its AdamW moments) in bf16 on the ranks (docs/optimizer.md,
  "Momentum dtype"); its oracle puts it in a bf16 group of its own, as
  tests/momentum_scenarios.py does, decided here from the placements with torch's own shard
  arithmetic (:func:`falls_back`), not dmuon's, and the state's form is checked too;
- ``memory``: the storages of live tensors that appeared over the steps (every tensor
  ``gc`` sees, a DTensor's local tensor for it, deduplicated by storage), less those the
  optimizer's state holds, after ``zero_grad(set_to_none=True)``: bytes, and what holds
  the largest (check c); and each parameter's kept state's whole bytes against the documented
  size (a Muon momentum, or each of AdamW's two moments of a matrix: ``param``: the
  parameter's bytes, bf16: 2, int8: 1 + 4 per 128-element block of a row; a vector's AdamW
  moments: the parameter's bytes whatever ``adamw_state_dtype`` is);
- ``resume``: a DCP checkpoint written after the steps, loaded into a fresh model and
  optimizer under another layout at the same P (``tests.shape_cases.RESUME_LAYOUT``), one
  more step: what differs from the oracle's uninterrupted run (check d).

The ranks agree after each phase (a small host exchange on a group of their own) so that
an error on one rank stops the case on every rank before the next collective; a case that
makes no progress for ``check_timeout_s`` ends the process (``tests.fault_runner``'s
watchdog), and a case whose ranks erred in different phases ends the launch.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import re
import shutil
import time
import traceback
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from benchmarks.layouts import as_dtensor
from benchmarks.live_tensors import live_storages, state_storages, storage_key
from dmuon import DMuon
from dmuon.state import kept_state
from tests.named_checkpoints import load_named, save_named
from tests.fault_runner import LaunchStop, _bits_equal, _watchdog
from tests.shape_cases import (BLOCK, Case, Param, cuts_rows, params_of, parse, piece_numel, placements_of,
                               row_length, rows_of)

STEPS = 2  # before the checkpoint; one more after it
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOMENTUM = {"param": None, "bf16": "bfloat16", "int8": "int8"}  # momentum_dtype and adamw_state_dtype
MOMENTUM_KEYS = ("momentum_buffer", "momentum_int8", "momentum_scales")
ADAMW_KEYS = ("exp_avg", "exp_avg_int8", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_root_int8",
              "exp_avg_sq_root_scales")
LIBRARY_PIECE_NUMEL = kept_state.CPU_PIECE_NUMEL  # a case's pieces: tests.shape_cases.piece_numel
SCALAR_BYTES = 8  # a storage this small is a 0-dim scalar (reported apart: check c's allowance)
# Tensors that may outlive a step by design, by their holder's type (check c allows them up to
# tests.shape_sweep.STATUS_ALLOWANCE): the step's status sums (int32, one per DTensor parameter
# and a few), read at the next step's start (dmuon.exchange.status_masks: no host sync in a step).
ALLOWED_HOLDERS = {"HostCopy": "the step's status sums, read at the next step"}


# ------------------------------------------------------------------------- the model


def options(case: Case) -> dict[str, Any]:
    """DMuon's keyword options for the case."""
    kwargs: dict[str, Any] = dict(lr=0.03, momentum=0.9, weight_decay=0.05, adamw_lr=0.01,
                                  nesterov="nonest" not in case.switches, normuon="normuon" in case.switches,
                                  normuon_beta2=0.9, cautious_weight_decay="cwd" in case.switches,
                                  ns_dtype="bfloat16" if "nsbf16" in case.switches else "float32")
    kwargs.update({"loop": dict(foreach=False), "foreach": dict(foreach=True),
                   "fused": dict(foreach=True, fused=True), "capturable": dict(capturable=True)}[case.form])
    return kwargs


def _seeded(case: Case, param: Param, salt: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{case.seed}-{param.name}".encode()) + 7919 * salt)
    return torch.randn(param.shape, generator=generator).to(dtype)


def initial(case: Case, param: Param) -> torch.Tensor:
    return _seeded(case, param, 0, DTYPES[case.pdtype])


def grad(case: Case, param: Param, step: int) -> torch.Tensor:
    return _seeded(case, param, 1 + step, DTYPES[case.pdtype])


def meshes(world: int, _cache: dict = {}) -> dict[str, Any]:  # noqa: B006 - made once per launch
    if world not in _cache:
        found = {"world": init_device_mesh("cpu", (world,))}
        if world == 4:
            found["grid"] = init_device_mesh("cpu", (2, 2))
        _cache[world] = found
    return _cache[world]


def _placement(spec: str):
    if spec == "R":
        return Replicate()
    if spec.startswith("SS"):
        return _StridedShard(int(spec[2:]), split_factor=2)
    return Shard(int(spec[1:]))


def layout_of(case: Case, param: Param, layout: str | None = None) -> tuple[Any, tuple]:
    """(mesh, placements) of ``param`` under ``layout``."""
    mesh_name, specs = placements_of(case, param, layout)
    return meshes(case.world)[mesh_name], tuple(_placement(s) for s in specs)


def falls_back(case: Case, param: Param, layout: str | None = None) -> bool:
    """Whether int8 momentum (or int8 AdamW moments) must be kept in bf16 for ``param`` under
    ``layout`` (docs/optimizer.md, "Momentum dtype"): its rows are narrower than 5 elements, or
    its placements cut the rows of a 4-D weight, or cut a row of a 2-D/3-D one so that some
    rank's part does not start on a block or its scales, cut by the same placements, are not
    its blocks' (every rank's box from torch's shard arithmetic). A vector keeps AdamW moments
    in its own dtype: never."""
    if param.kind == "vector":
        return False
    if row_length(param.shape) < 5:  # rows too narrow for int8 to pay (docs/optimizer.md): bf16 on any layout
        return True
    mesh_name, specs = placements_of(case, param, layout)
    if not cuts_rows(len(param.shape), specs):
        return False
    if len(param.shape) > 3:
        return True
    mesh_shape = (case.world,) if mesh_name == "world" else (2, 2)
    placements = tuple(_placement(s) for s in specs)
    scales = param.shape[:-1] + (math.ceil(param.shape[-1] / BLOCK),)
    for coordinate in (list(c) for c in torch.cartesian_prod(*[torch.arange(n) for n in mesh_shape]).reshape(
            -1, len(mesh_shape)).tolist()):
        shape, offset = _compute_local_shape_and_global_offset(param.shape, mesh_shape, coordinate, placements)
        sshape, soffset = _compute_local_shape_and_global_offset(scales, mesh_shape, coordinate, placements)
        start, length = offset[-1], shape[-1]
        if length:
            wanted = (start // BLOCK, math.ceil((start + length) / BLOCK) - start // BLOCK)
            if start % BLOCK or (soffset[-1], sshape[-1]) != wanted:
                return True
        elif sshape[-1]:
            return True
    return False


def fallbacks(case: Case, layout: str | None = None) -> tuple[set[str], set[str]]:
    """The names whose int8 state is kept in bf16 under ``layout``: Muon parameters under int8
    ``momentum_dtype``, AdamW matrices under int8 ``adamw_state_dtype``."""
    params = params_of(case)
    return ({p.name for p in params if not p.adamw and case.mdtype == "int8" and falls_back(case, p, layout)},
            {p.name for p in params if p.adamw and case.adtype == "int8" and falls_back(case, p, layout)})


def _groups(named: list[tuple[str, nn.Parameter]], case: Case, bf16: set[str]) -> list[dict[str, Any]]:
    """One group, split by DMuon (ndim >= 2: Muon, but ``embed.*``; vectors: AdamW) in the
    case's order; the ``bf16`` ones (int8 state falling back) in a second group with bf16
    momentum and bf16 AdamW moments."""
    groups = [{"params": [(n, p) for n, p in named if n not in bf16]}]
    if bf16:
        groups.append({"params": [(n, p) for n, p in named if n in bf16], "momentum_dtype": "bfloat16",
                       "adamw_state_dtype": "bfloat16"})
    return groups


class Model:
    """The case's parameters (DTensors under ``layout``, or plain full tensors for the oracle)
    and their DMuon."""

    def __init__(self, case: Case, layout: str | None, zeros: bool = False, oracle_bf16: set[str] = frozenset()):
        self.case, self.layout = case, layout
        self.specs = params_of(case)
        self.params: dict[str, nn.Parameter] = {}
        for param in self.specs:
            full = initial(case, param)
            if zeros:
                full = torch.zeros_like(full)
            if layout is None:
                self.params[param.name] = nn.Parameter(full)
            else:
                mesh, placements = layout_of(case, param, layout)
                self.params[param.name] = nn.Parameter(as_dtensor(full, mesh, placements))
        named = list(self.params.items())
        kept_state.CPU_PIECE_NUMEL = piece_numel(case) or LIBRARY_PIECE_NUMEL  # the oracle's and the ranks' alike
        kwargs = dict(options(case), momentum_dtype=MOMENTUM[case.mdtype],
                      adamw_state_dtype=MOMENTUM[case.adtype])
        self.optimizer = DMuon(_groups(named, case, set(oracle_bf16)) if layout is None else named, **kwargs)

    def set_grads(self, step: int) -> None:
        for param in self.specs:
            full = grad(self.case, param, step)
            mine = self.params[param.name]
            mine.grad = as_dtensor(full, mine.device_mesh, mine.placements) if isinstance(mine, DTensor) else full

    def step(self, step: int) -> None:
        self.set_grads(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------- checks


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _same(mine: Any, want: Any, approx: bool) -> bool:
    if not isinstance(want, torch.Tensor) or not isinstance(mine, torch.Tensor):
        return (mine.item() if isinstance(mine, torch.Tensor) else mine) == (
            want.item() if isinstance(want, torch.Tensor) else want)
    mine, want = mine.detach().cpu(), want.detach().cpu()
    if approx and mine.shape == want.shape and mine.dtype == want.dtype and mine.is_floating_point():
        return torch.allclose(mine.float(), want.float(), rtol=1e-2 if mine.dtype == torch.bfloat16 else 1e-5,
                              atol=1e-6, equal_nan=True)
    if approx and mine.shape == want.shape and mine.dtype == want.dtype == torch.int8:
        return bool(((mine.int() - want.int()).abs() <= 1).all())  # a moment an ulp apart may round to a neighbour
    if mine.dtype == torch.int8 or mine.dtype == torch.bool:
        return mine.shape == want.shape and mine.dtype == want.dtype and torch.equal(mine, want)
    if mine.ndim == 0 and want.ndim == 0 and mine.dtype != want.dtype:
        return False
    return _bits_equal(mine.reshape(-1) if mine.ndim == 0 else mine, want.reshape(-1) if want.ndim == 0 else want)


def _approx(case: Case, param: Param, layouts: tuple[str, ...]) -> bool:
    """torch's fused CPU AdamW rounds a shard's vector body and tail differently: an AdamW
    parameter sharded under any of ``layouts`` (the run's, and before a resume the saved one's)
    under ``fused`` matches one process closely, not bitwise (docs/optimizer.md, "foreach and
    fused"; tests/fault_runner.py excuses it the same way)."""
    return case.form == "fused" and param.adamw and case.world > 1 and any(
        s != "R" for layout in layouts for s in placements_of(case, param, layout)[1])


def compare(model: Model, oracle: Model, meet, only: set[str] | None = None, saved: str | None = None) -> list[str]:
    """What of ``model`` (every rank takes part) is not the oracle's: weights, state keys,
    and every state value gathered whole. State keys are agreed across ranks first, so a rank
    with other keys cannot leave the gathers out of step."""
    names = [p for p in model.specs if only is None or p.name in only]
    keys = {p.name: sorted(model.optimizer.state.get(model.params[p.name], {})) for p in names}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys, group=meet)
    differ = []
    for param in names:
        mine, want = model.params[param.name], oracle.params[param.name]
        approx = _approx(model.case, param, (model.layout,) + ((saved,) if saved else ()))
        if not _same(_whole(mine.detach()), want.detach(), approx):
            differ.append(f"{param.name}{list(param.shape)} weights")
        theirs = oracle.optimizer.state.get(want, {})
        held = model.optimizer.state.get(mine, {})
        if any(k[param.name] != keys[param.name] for k in every):
            differ.append(f"{param.name}: state keys differ across ranks: {[k[param.name] for k in every]}")
            continue
        if sorted(theirs) != keys[param.name]:
            differ.append(f"{param.name}{list(param.shape)} state keys {keys[param.name]}, one process {sorted(theirs)}")
        for key in keys[param.name]:
            if key in theirs and not _same(_whole(held[key]), theirs[key], approx):
                differ.append(f"{param.name}{list(param.shape)}/{key}")
    return differ


def _ours(obj: Any) -> bool:
    """A frame, function or closure cell of this file (the census's own references)."""
    kind = type(obj).__name__
    if kind == "frame":
        return obj.f_code.co_filename == __file__
    if kind == "function":
        return obj.__code__.co_filename == __file__
    if kind == "cell":  # held by a function's __closure__ tuple
        closures = [r for r in gc.get_referrers(obj) if isinstance(r, tuple)]
        return any(_ours(f) for c in closures for f in gc.get_referrers(c) if type(f).__name__ == "function")
    return False


def _holder(tensor: torch.Tensor, ignore: set[int], depth: int = 3) -> str:
    """Who holds ``tensor``: the chain of its referrers' types (a dict's key; a frame's
    function), a few levels up; ``ignore``: the ids of the harness's own containers."""
    chain, target = [], tensor
    for _ in range(depth):
        referrers = [r for r in gc.get_referrers(target) if id(r) not in ignore and not _ours(r)]
        if not referrers:
            break
        holder = referrers[0]
        if isinstance(holder, dict):
            key = "?"
            for name, value in holder.items():  # a loop, not a closure: target stays a plain local
                if value is target:
                    key = name
                    break
            chain.append(f"dict[{str(key)[:40]}]")
        elif type(holder).__name__ == "function":
            chain.append(f"function {holder.__module__}.{holder.__qualname__}")
            break
        elif type(holder).__name__ == "frame":
            chain.append(f"frame {holder.f_code.co_name} ({os.path.basename(holder.f_code.co_filename)}:"
                         f"{holder.f_lineno})")
            break
        else:
            chain.append(type(holder).__name__)
        ignore = ignore | {id(referrers)}
        target = holder
    return " <- ".join(chain) or "no Python referrer"


def census(model: Model, before: dict[int, tuple[int, torch.Tensor]]) -> dict[str, Any]:
    """Check c's figures: the storages alive now that were not before the first step, less the
    optimizer state's, by kind: 0-dim scalars, allowed holders (:data:`ALLOWED_HOLDERS`), the
    rest (with who holds the largest). A storage no Python object holds may still be held by a
    gloo work a moment after its ``wait()`` returned (its worker thread lets go of the work's
    tensors after it marks the work done): those are counted again after a short pause."""
    for pause in (0.05, 0.25, None):
        figures = _census(model, before)
        if pause is None or not figures.pop("unheld"):
            return figures
        time.sleep(pause)
    raise AssertionError("unreachable")


def _census(model: Model, before: dict[int, tuple[int, torch.Tensor]]) -> dict[str, Any]:
    """One count of :func:`census`, with ``unheld``: whether a storage beyond the allowances
    has no Python holder."""
    gc.collect()
    after = live_storages()
    held = state_storages(model.optimizer)
    new = [ptr for ptr in after if ptr not in before and ptr not in held]
    own = {id(after), id(before), id(new)} | {id(v) for v in after.values()} | {id(v) for v in before.values()}
    scalars = [ptr for ptr in new if after[ptr][0] <= SCALAR_BYTES]
    holders = {ptr: _holder(after[ptr][1], own, 1) for ptr in new if ptr not in scalars}
    allowed = [ptr for ptr in holders if holders[ptr] in ALLOWED_HOLDERS]
    rest = sorted((ptr for ptr in new if ptr not in scalars and ptr not in allowed), key=lambda p: -after[p][0])

    def describe(ptr: int, depth: int) -> str:
        tensor = after[ptr][1]
        return f"{after[ptr][0]} B {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} held by " \
               f"{_holder(tensor, own, depth)}"

    return {
        "unheld": any(holders[p] == "no Python referrer" for p in rest),
        "extra_bytes": sum(after[p][0] for p in rest),
        "extra_top": [describe(p, 3) for p in rest[:4]],
        "scalars": len(scalars),
        "scalar_kinds": sorted({describe(p, 2) for p in scalars[:6]}),
        "allowed_bytes": sum(after[p][0] for p in allowed),
        "allowed_kinds": sorted({describe(p, 1) for p in allowed})[:3],
        "state_local_bytes": sum(after[p][0] for p in after if p in held),
        "muon_local": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                          for s, p in zip(model.specs, model.params.values()) if not _adamw(s)),
    }


def _adamw(spec: Any) -> bool:
    """Whether a parameter spec (this sweep's, or the memory sweep's: Muon parameters only) is
    of the AdamW part."""
    return spec.kind in ("vector", "embed")


def expected_state_bytes(case: Case, param: Param, bf16: bool) -> int:
    """The documented whole size of a parameter's kept state (docs/optimizer.md's table): a Muon
    parameter's momentum in ``momentum_dtype``, an AdamW matrix's two moments each in
    ``adamw_state_dtype``, a vector's two in its own dtype; ``bf16``: int8 falling back."""
    numel = math.prod(param.shape)
    form = ("param" if param.kind == "vector" else case.adtype) if param.adamw else case.mdtype
    if form == "int8" and not bf16:
        one = numel + 4 * rows_of(param.shape) * math.ceil(row_length(param.shape) / BLOCK)
    elif form == "param":
        one = numel * DTYPES[case.pdtype].itemsize
    else:
        one = numel * 2
    return 2 * one if param.adamw else one


def state_bytes(model: Model) -> dict[str, int]:
    """Per parameter, the whole bytes of its kept state (global shapes of DTensors): a Muon
    parameter's momentum, an AdamW parameter's two moments (not its step count)."""
    out = {}
    for param in model.specs:
        state = model.optimizer.state.get(model.params[param.name], {})
        keys = ADAMW_KEYS if param.adamw else MOMENTUM_KEYS
        out[param.name] = sum(math.prod(v.shape) * v.dtype.itemsize for k, v in state.items()
                              if k in keys and isinstance(v, torch.Tensor))
    return out


# ------------------------------------------------------------------------- one case


class Stop(Exception):
    """A phase failed on some rank: the case ends on every rank."""


def _agree(meet, failed: bool) -> None:
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, failed, group=meet)
    if any(flags):
        raise Stop([r for r, f in enumerate(flags) if f])


def run_case(case: Case, out_dir: str, meet) -> dict[str, Any]:
    """Everything this rank observed in one case (JSON-ready)."""
    start = time.perf_counter()
    obs: dict[str, Any] = {"errors": {}}
    muon_here, adamw_here = fallbacks(case)
    muon_there, adamw_there = fallbacks(case, case.resume_layout)
    bf16_here, bf16_there = muon_here | adamw_here, muon_there | adamw_there
    obs["bf16_fallback"] = sorted(muon_here)
    obs["adamw_bf16_fallback"] = sorted(adamw_here)

    def phase(name: str, fn):  # noqa: ANN001, ANN202
        try:
            value, failed = fn(), False
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - recorded, named by phase (DCP's is a BaseException)
            obs["errors"][name] = _said(error)[:1500] + " @ " + _where(error)
            value, failed = None, True
        _agree(meet, failed)
        return value

    try:
        model = phase("build", lambda: Model(case, case.layout))

        def steps() -> dict[str, Any]:
            model.set_grads(0)
            gc.collect()  # settle cycles before the census
            before = live_storages()  # held meanwhile: no address is reused
            model.optimizer.step()
            model.optimizer.zero_grad(set_to_none=True)
            for step in range(1, STEPS):
                model.step(step)
            return census(model, before)

        obs["memory"] = phase("steps", steps)
        oracle = Model(case, None, oracle_bf16=bf16_here)  # one process, after the census
        for step in range(STEPS):
            oracle.step(step)
        obs["differ"] = phase("compare", lambda: compare(model, oracle, meet))
        got = state_bytes(model)
        obs["state_bytes"] = {p.name: [got[p.name], expected_state_bytes(case, p, p.name in bf16_here)]
                              for p in model.specs}
        obs["held_as"] = {p.name: _held_as(model.optimizer.state.get(model.params[p.name], {}))
                          for p in model.specs if not p.adamw}
        obs["adamw_held_as"] = {p.name: _held_as(model.optimizer.state.get(model.params[p.name], {}), "exp_avg")
                                for p in model.specs if p.kind == "embed"}

        folder = os.path.join(out_dir, "ckpt", case.id)
        phase("save", lambda: save_named(folder, model.params, model.optimizer))
        oracle.step(STEPS)  # the uninterrupted run's next step
        obs["resume"] = {"layout": case.resume_layout, "form_changes": sorted(bf16_here ^ bf16_there)}

        def resume() -> Model:
            fresh = Model(case, case.resume_layout, zeros=True)
            load_named(folder, fresh.params, fresh.optimizer)
            return fresh

        fresh = phase("load", resume)
        phase("resumed_step", lambda: fresh.step(STEPS))
        same_form = {p.name for p in fresh.specs} - (bf16_here ^ bf16_there)
        obs["resume"]["differ"] = phase("resumed_compare", lambda: compare(fresh, oracle, meet, same_form, case.layout))
    except Stop as stop:
        obs["stopped_by"] = stop.args[0]
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(out_dir, "ckpt", case.id), ignore_errors=True)
    obs["seconds"] = round(time.perf_counter() - start, 3)
    return obs


def _held_as(state: dict[str, Any], key: str = "momentum") -> str | None:
    """The dtype a kept state is held in: ``key``'s int8 values, or its float buffer."""
    value = state.get(f"{key}_int8", state.get("momentum_buffer" if key == "momentum" else key))
    return None if value is None else str(value.dtype).removeprefix("torch.")


def _said(error: BaseException) -> str:
    """An error's type and message; for DCP's (every rank's tracebacks in one text), the
    first line that names an error."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, CheckpointException):
        said = [line.strip() for line in str(error).splitlines() if re.match(r"\s*\w+(Error|Exception): ", line)]
        text = f"CheckpointException: {said[0]}" if said else text
    return text


def _where(error: BaseException) -> str:
    """The innermost frame of dmuon (or else the last) the error came from."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/dmuon/" in f.filename] or frames[-1:]
    return f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"


# ------------------------------------------------------------------------- the launch


def run_cases(case_ids: list[str], out_dir: str, check_timeout_s: float) -> dict[str, Any]:
    """Run the cases on this rank; one JSON line each in ``out_dir/rank<r>.jsonl``."""
    rank = dist.get_rank()
    # full_tensor() of a _StridedShard DTensor warns of its two all_gathers on every rank, every time.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    meet = dist.new_group(backend="gloo", timeout=timedelta(seconds=check_timeout_s))
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    for case_id in case_ids:
        case = parse(case_id)
        timer = _watchdog(check_timeout_s, path, case_id, rank)
        try:
            obs = run_case(case, out_dir, meet)
        except Exception as error:  # noqa: BLE001 - a harness error is reported with its case
            obs = {"harness_error": f"{type(error).__name__}: {error} @ {_where(error)}"}
        with open(path, "a") as out:
            out.write(json.dumps({"case": case_id, "rank": rank, "obs": obs}) + "\n")
        phases: list = [None] * dist.get_world_size()
        dist.all_gather_object(phases, sorted(obs.get("errors", {})), group=meet)
        timer.cancel()
        if any(p != phases[0] for p in phases):
            raise LaunchStop(f"{case_id}: ranks failed in different phases {phases}; ending the launch")
    return {"done": len(case_ids)}
