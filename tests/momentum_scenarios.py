"""Worker functions for tests/test_momentum_dtype_ranks.py: momentum kept in bf16 or int8
(``DMuon(momentum_dtype=...)``), stepped on real gloo ranks and compared bit for bit with
single-process DMuon (P = 1) with the same options: the weights, and every rank's momentum
state (values and scales) gathered whole.

- FSDP: ``Shard(0)`` over every rank, shapes with several 128-element blocks per row and
  row counts that leave uneven and empty shards at P = 2 and 4, a 3-D expert stack;
- the 2 x 2 mesh layouts of tests/mesh_scenarios.py (HSDP, FSDP + TP, TP, EP), plus TP's
  column cut on block boundaries; a cut off them keeps that parameter's momentum in bf16,
  so its oracle is single-process DMuon with bf16 momentum;
- DCP: a checkpoint written on one world size, resumed on another.

Every group runs Nesterov, NorMuon and cautious weight decay.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from benchmarks.layouts import as_dtensor
from dmuon import DMuon
from tests.named_checkpoints import load_named, save_named
from tests.distributed_scenarios import _device, device_type
from tests.mesh_scenarios import MESH_CASES

MOMENTUM_DTYPES = ("bfloat16", "int8")
OPTIONS = dict(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.05, normuon=True, cautious_weight_decay=True,
               ns_dtype="float32")
# Rows of 6, 5, 3 and 7: uneven shards at P = 2 and 4, an empty one at P = 4 (and for
# the 3-expert stack); 300 and 130 columns: full and short blocks in one row.
FSDP_CASES = {"blocks": (6, 300), "uneven": (5, 130), "experts": (3, 4, 140), "narrow": (7, 6)}
# TP's column cut (Shard(1)) of 256 and 512 columns on 2 ranks: 128 and 256 a rank, on block boundaries.
BLOCK_CASES = [("tp.rowwise_blocks", (6, 256), (Replicate(), Shard(1))),
               ("fsdp_tp.rowwise_blocks", (4, 512), (Shard(0), Shard(1)))]
MESH_MOMENTUM_CASES = [case for group in MESH_CASES.values() for case in group] + BLOCK_CASES
# The cases whose column cut is off the blocks (10 columns on 2 ranks): bf16 momentum.
OFF_BLOCKS = ("fsdp_tp.rowwise", "tp.rowwise")
STEPS = 3


def _tensors(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(_device()) for name, shape in shapes.items()}


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def held_as(state: dict[str, Any]) -> str:
    """How a state holds its momentum: ``"int8"``, ``"bfloat16"``, ``"float32"``."""
    return str(state.get("momentum_int8", state.get("momentum_buffer")).dtype).removeprefix("torch.")


def agreement(params: dict[str, nn.Parameter], optimizer: DMuon, oracle: dict[str, nn.Parameter],
              reference: DMuon) -> dict[str, dict[str, bool]]:
    """Per parameter: whether its weights and its whole momentum state (values, scales) equal
    the oracle's, bitwise (every rank takes part: whole DTensors are gathered)."""
    out = {}
    for name, param in params.items():
        mine, theirs = optimizer.state[param], reference.state[oracle[name]]
        keys = ("momentum_buffer", "momentum_int8", "momentum_scales")
        out[name] = {
            "weights": torch.equal(_whole(param.detach()), oracle[name].detach()),
            "momentum": all((k in mine) == (k in theirs) for k in keys) and all(
                torch.equal(_whole(mine[k]), theirs[k]) for k in keys if k in theirs),
            "held_as": held_as(mine),
        }
    return out


def _groups(params: dict[str, nn.Parameter], momentum_dtype: str, off_blocks: tuple[str, ...] = ()
            ) -> list[dict[str, Any]]:
    """One Muon group with ``momentum_dtype``; the ``off_blocks`` parameters in one of their
    own with bf16 (the oracle of a parameter whose layout cuts rows off the blocks)."""
    groups = [{"params": [(n, p) for n, p in params.items() if n not in off_blocks], "use_muon": True,
               "momentum_dtype": momentum_dtype}]
    if any(n in off_blocks for n in params):
        groups.append({"params": [(n, p) for n, p in params.items() if n in off_blocks], "use_muon": True,
                       "momentum_dtype": "bfloat16"})
    return groups


def _run(params: dict[str, nn.Parameter], optimizer: DMuon, shapes: dict[str, tuple[int, ...]], steps: range,
         place=lambda name, t: t) -> None:
    for step in steps:
        for name, grad in _tensors(100 + step, shapes).items():
            params[name].grad = place(name, grad)
        optimizer.step()


MESH_SHAPES = {name: shape for name, shape, _ in MESH_MOMENTUM_CASES}
MESH_PLACEMENTS = {name: placements for name, _, placements in MESH_MOMENTUM_CASES}


def _off_blocks(momentum_dtype: str | None) -> tuple[str, ...]:
    """The mesh cases a single process keeps in bf16 to match the ranks' fallback."""
    return OFF_BLOCKS if momentum_dtype == "int8" else ()


def _oracle(shapes: dict[str, tuple[int, ...]], momentum_dtype: str | None, steps: int,
            off_blocks: tuple[str, ...] = ()) -> tuple[dict[str, nn.Parameter], DMuon]:
    """Single-process DMuon on the whole tensors, ``steps`` steps."""
    oracle = {n: nn.Parameter(t) for n, t in _tensors(0, shapes).items()}
    reference = DMuon(_groups(oracle, momentum_dtype, off_blocks), **OPTIONS)
    _run(oracle, reference, shapes, range(steps))
    return oracle, reference


def _on_ranks(shapes: dict[str, tuple[int, ...]], placements: Any, mesh_shape: tuple[int, ...],
              momentum_dtype: str | None, off_blocks: tuple[str, ...] = (), zeros: bool = False,
              **options: Any):
    """The cases as DTensors of ``placements`` (one for all, or by name) on a ``mesh_shape``
    mesh (zeros: for a checkpoint to fill), their DMuon (``options`` beside :data:`OPTIONS`),
    and how a grad is placed."""
    mesh = init_device_mesh(device_type(), mesh_shape)

    def place(name: str, t: torch.Tensor) -> torch.Tensor:
        return as_dtensor(t, mesh, placements[name] if isinstance(placements, dict) else placements)

    params = {n: nn.Parameter(place(n, torch.zeros_like(t) if zeros else t)) for n, t in _tensors(0, shapes).items()}
    return params, DMuon(_groups(params, momentum_dtype, off_blocks), **OPTIONS, **options), place


def _fsdp(momentum_dtype: str | None, zeros: bool = False):
    """:data:`FSDP_CASES` on ``Shard(0)`` over every rank (:func:`_on_ranks`)."""
    return _on_ranks(FSDP_CASES, [Shard(0)], (dist.get_world_size(),), momentum_dtype, zeros=zeros)


def fsdp_exactness(momentum_dtype: str) -> dict[str, dict[str, bool]]:
    """``Shard(0)`` over every rank vs single process, :data:`STEPS` steps."""
    params, optimizer, place = _fsdp(momentum_dtype)
    _run(params, optimizer, FSDP_CASES, range(STEPS), place)
    return agreement(params, optimizer, *_oracle(FSDP_CASES, momentum_dtype, STEPS))


def mesh_exactness(momentum_dtype: str, split_replicas: bool | None = None) -> dict[str, dict[str, bool]]:
    """Every layout of :data:`MESH_MOMENTUM_CASES` on a 2 x 2 mesh, in one group (the ranks
    choose the bf16 fallback), vs single process. ``split_replicas=True``: HSDP's second
    replica holds blocks it never sends (the owner's replica sources them), whose momentum
    still takes its EMA every step (``dmuon.step.converted_momenta.ConvertedMomenta.unpacked``)."""
    params, optimizer, place = _on_ranks(MESH_SHAPES, MESH_PLACEMENTS, (2, 2), momentum_dtype,
                                         split_replicas=split_replicas)
    _run(params, optimizer, MESH_SHAPES, range(STEPS), place)
    return agreement(params, optimizer, *_oracle(MESH_SHAPES, momentum_dtype, STEPS, _off_blocks(momentum_dtype)))


# ------------------------------------------------------------------------------ DCP


def checkpoint_save(checkpoint_dir: str, momentum_dtype: str, steps: int) -> None:
    """``steps`` steps on ``Shard(0)`` over every rank, then a DCP checkpoint."""
    params, optimizer, place = _fsdp(momentum_dtype)
    _run(params, optimizer, FSDP_CASES, range(steps), place)
    save_named(checkpoint_dir, params, optimizer)


def checkpoint_resume(checkpoint_dir: str, momentum_dtype: str, done: int, total: int) -> dict[str, dict[str, bool]]:
    """That checkpoint loaded on this world size (fresh weights and optimizer), steps
    ``done..total`` run, against single-process DMuon run ``total`` steps uninterrupted."""
    params, optimizer, place = _fsdp(momentum_dtype, zeros=True)
    load_named(checkpoint_dir, params, optimizer)
    _run(params, optimizer, FSDP_CASES, range(done, total), place)
    return agreement(params, optimizer, *_oracle(FSDP_CASES, momentum_dtype, total))


def _mesh_layouts(mesh_shape: tuple[int, int], momentum_dtype: str, zeros: bool = False):
    """:data:`MESH_MOMENTUM_CASES` on a ``mesh_shape`` mesh, in the groups of the oracle (the
    off-block cases in a bf16 group of their own with int8)."""
    return _on_ranks(MESH_SHAPES, MESH_PLACEMENTS, mesh_shape, momentum_dtype, _off_blocks(momentum_dtype), zeros)


def mesh_checkpoint_save(checkpoint_dir: str, momentum_dtype: str, steps: int) -> None:
    """``steps`` steps of every mesh layout on a 2 x 2 mesh, then a DCP checkpoint."""
    params, optimizer, place = _mesh_layouts((2, 2), momentum_dtype)
    _run(params, optimizer, MESH_SHAPES, range(steps), place)
    save_named(checkpoint_dir, params, optimizer)


def mesh_checkpoint_resume(checkpoint_dir: str, momentum_dtype: str, done: int, total: int
                           ) -> dict[str, dict[str, bool]]:
    """That checkpoint resumed on one rank (a 1 x 1 mesh: every tensor whole), steps
    ``done..total`` run, against single-process DMuon run ``total`` steps uninterrupted."""
    params, optimizer, place = _mesh_layouts((1, 1), momentum_dtype, zeros=True)
    load_named(checkpoint_dir, params, optimizer)
    _run(params, optimizer, MESH_SHAPES, range(done, total), place)
    return agreement(params, optimizer,
                     *_oracle(MESH_SHAPES, momentum_dtype, total, _off_blocks(momentum_dtype)))


def checkpoint_load_as(checkpoint_dir: str, saved_dtype: str | None, momentum_dtype: str | None
                       ) -> dict[str, Any]:
    """A checkpoint of 2 steps saved with ``saved_dtype``, loaded through DCP into an
    optimizer with ``momentum_dtype``: ``{"error": what the load raised or None, "momentum":
    {case: the loaded momentum is the saved one cast to the new dtype}}`` (the saved one
    recomputed by single-process DMuon)."""
    from torch.distributed.checkpoint.api import CheckpointException

    oracle, reference = _oracle(FSDP_CASES, saved_dtype, 2)
    params, optimizer, _ = _fsdp(momentum_dtype, zeros=True)
    try:
        load_named(checkpoint_dir, params, optimizer, weights=False)
    except CheckpointException as error:  # a BaseException: DCP's, from every rank's planner
        return {"error": f"{type(error).__name__}: {error}", "momentum": {}}
    loaded = {n: _whole(optimizer.state[p]["momentum_buffer"]) for n, p in params.items()}
    saved = {n: reference.state[p]["momentum_buffer"] for n, p in oracle.items()}
    return {"error": None, "momentum": {n: torch.equal(loaded[n], saved[n].to(loaded[n].dtype)) for n in params}}


# ------------------------------------------- a plain state dict across the bf16 fallback (issue 60, item 4)


def mesh_plain_resume(momentum_dtype: str, done: int, total: int) -> dict[str, dict[str, bool]]:
    """Every mesh layout in ONE group (the ranks choose the bf16 fallback), ``done`` steps, then
    ``state_dict()`` loaded by ``load_state_dict`` into a fresh DMuon on the same layout (a
    resume through a plain state dict), steps ``done..total``, against single process: each
    momentum stays in the form its layout keeps (the fallback's bf16 is not converted to the
    group's int8)."""
    params, optimizer, place = _on_ranks(MESH_SHAPES, MESH_PLACEMENTS, (2, 2), momentum_dtype)
    _run(params, optimizer, MESH_SHAPES, range(done), place)
    saved = optimizer.state_dict()
    resumed_params = {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}
    resumed = DMuon(_groups(resumed_params, momentum_dtype), **OPTIONS)
    resumed.load_state_dict(saved)
    _run(resumed_params, resumed, MESH_SHAPES, range(done, total), place)
    return agreement(resumed_params, resumed, *_oracle(MESH_SHAPES, momentum_dtype, total, _off_blocks(momentum_dtype)))


def mesh_full_state(momentum_dtype: str, steps: int) -> dict[str, Any] | None:
    """Every mesh layout in one group, ``steps`` steps, then the whole state dict gathered
    (``full_tensor`` of every DTensor): rank 0 returns ``{"weights": name -> tensor,
    "state_dict": the optimizer's, whole}``, the others None."""
    params, optimizer, place = _on_ranks(MESH_SHAPES, MESH_PLACEMENTS, (2, 2), momentum_dtype)
    _run(params, optimizer, MESH_SHAPES, range(steps), place)
    saved = optimizer.state_dict()
    whole = {**saved, "state": {i: {k: _whole(v) for k, v in entry.items()} for i, entry in saved["state"].items()}}
    weights = {n: _whole(p.detach()) for n, p in params.items()}
    return {"weights": weights, "state_dict": whole} if dist.get_rank() == 0 else None


def resume_whole(saved: dict[str, Any], momentum_dtype: str, done: int, total: int) -> dict[str, Any]:
    """One process: :func:`mesh_full_state`'s state loaded into single-process DMuon (every
    row whole: no fallback), steps ``done..total``; against single process run ``done`` steps
    with the ranks' forms (the off-block cases in bf16), its state dict loaded into a DMuon
    with ``momentum_dtype`` for all, the same steps: ``{"agreement": each case's agreement
    and form, "log": the load's dmuon log lines}``. On one rank (for the device)."""
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    params = {n: nn.Parameter(t.clone()) for n, t in saved["weights"].items()}
    resumed = DMuon(_groups(params, momentum_dtype), **OPTIONS)
    logger, level = logging.getLogger("dmuon"), logging.getLogger("dmuon").level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        resumed.load_state_dict(saved["state_dict"])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    _run(params, resumed, MESH_SHAPES, range(done, total))
    oracle, reference = _oracle(MESH_SHAPES, momentum_dtype, done, _off_blocks(momentum_dtype))
    groups = _groups(oracle, momentum_dtype, _off_blocks(momentum_dtype))
    converted = DMuon([{**group, "momentum_dtype": momentum_dtype} for group in groups], **OPTIONS)
    converted.load_state_dict(reference.state_dict())
    _run(oracle, converted, MESH_SHAPES, range(done, total))
    return {"agreement": agreement(params, resumed, oracle, converted), "log": lines}


# The cases of a 1-D mesh of 2 ranks: a column cut off the blocks (5 columns a rank: bf16
# under int8) and a row cut (whole blocks: int8).
LINE_SHAPES = {"cut": (6, 10), "rows": (6, 300)}
LINE_PLACEMENTS = {"cut": (Shard(1),), "rows": (Shard(0),)}


def line_plain_resume_from_float(done: int) -> dict[str, dict[str, Any]]:
    """:data:`LINE_SHAPES` on 2 ranks with float32 momentum (``momentum_dtype=None``), ``done``
    steps, then ``state_dict()`` loaded by ``load_state_dict`` into a DMuon with int8 on the
    same layout: per case, the form its momentum is held in after the load, and whether it
    holds the saved momentum rounded once into that form (bf16, or int8's quantization)."""
    from dmuon.numerics.momentum_storage import quantize_int8

    params, optimizer, place = _on_ranks(LINE_SHAPES, LINE_PLACEMENTS, (2,), None)
    _run(params, optimizer, LINE_SHAPES, range(done), place)
    saved = optimizer.state_dict()
    fp32 = {n: _whole(optimizer.state[p]["momentum_buffer"]) for n, p in params.items()}
    resumed_params = {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}
    resumed = DMuon(_groups(resumed_params, "int8"), **OPTIONS)
    resumed.load_state_dict(saved)
    out = {}
    for name, param in resumed_params.items():
        state = resumed.state[param]
        if "momentum_int8" in state:
            values, scales = quantize_int8(fp32[name])
            rounded = (torch.equal(_whole(state["momentum_int8"]), values)
                       and torch.equal(_whole(state["momentum_scales"]), scales))
        else:
            rounded = torch.equal(_whole(state["momentum_buffer"]), fp32[name].to(state["momentum_buffer"].dtype))
        out[name] = {"held_as": held_as(state), "rounded_once": rounded}
    return out
