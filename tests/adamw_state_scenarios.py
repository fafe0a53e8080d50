"""Worker functions for tests/test_adamw_state_ranks.py: the AdamW part's moments kept in bf16 or
int8 (``DMuon(adamw_state_dtype=...)``, an AdamW group's ``state_dtype``), stepped on real gloo
ranks and compared bit for bit with single-process DMuon (P = 1) with the same options: the
weights, and every rank's whole state (every key: the moments' values and int8 scales, the step
counters; Muon's momentum for the Muon matrix beside them) gathered whole.

- FSDP: ``Shard(0)`` over every rank, AdamW parameters with several 128-element blocks per row
  and a short last block, row counts that leave uneven and empty shards at P = 2 and 4, a 3-D
  stack, rows of 3 (int8 falls back to bf16 whatever the layout) and a 1-D vector (kept in fp32
  whatever the option), in AdamW groups (``use_muon=False``) beside one Muon matrix;
- the 2 x 2 mesh layouts of tests/mesh_scenarios.py (HSDP, FSDP + TP, TP, EP) as AdamW
  parameters, plus TP's column cut on block boundaries (int8 stays int8); a cut off them keeps
  that parameter's moments in bf16, so its oracle is single-process DMuon with bf16 moments;
- DCP: a checkpoint written on one world size (or mesh), resumed on another;
- masks: a NaN in one rank's grad of one AdamW parameter under ``skip_nonfinite`` changes no
  bit anywhere, and the next step is the oracle's that never saw that step;
- the CPU's row pieces (``dmuon.state.kept_state.step_pieces``) small: cut at other rows on
  each rank than in the oracle.

Every run uses cautious weight decay with a weight decay above 0, several steps.
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
from dmuon.state import kept_state
from tests.named_checkpoints import load_named, save_named
from tests.distributed_scenarios import _device, device_type
from tests.momentum_scenarios import MESH_MOMENTUM_CASES, OFF_BLOCKS

STATE_DTYPES = ("bfloat16", "int8")
OPTIONS = dict(lr=0.03, momentum=0.9, weight_decay=0.05, cautious_weight_decay=True, adamw_lr=0.01,
               adamw_betas=(0.9, 0.95), ns_dtype="float32")
# The AdamW parameters under FSDP. Rows of 6, 5, 3 and 7: uneven shards at P = 2 and 4, an
# empty one at P = 4 (and for the 3-row stack); 300 and 130 columns: full and short blocks in
# one row; rows of 3: too narrow for int8 (bf16); a vector: the parameter's dtype.
FSDP_CASES = {"blocks": (6, 300), "uneven": (5, 130), "experts": (3, 4, 140), "narrow": (7, 3), "norm": (37,)}
# The Muon matrix beside them (its own group, fp32 momentum).
MUON_CASES = {"muon.matrix": (10, 24)}
# The AdamW parameters on a 2 x 2 mesh: every layout of tests/mesh_scenarios.py and the column
# cuts on block boundaries (tests/momentum_scenarios.py); the Muon matrix under HSDP.
MESH_CASES = {name: shape for name, shape, _ in MESH_MOMENTUM_CASES}
MESH_PLACEMENTS = {name: placements for name, _, placements in MESH_MOMENTUM_CASES}
MESH_PLACEMENTS["muon.matrix"] = (Replicate(), Shard(0))
STEPS = 3
# skip_nonfinite: the step whose grad gets a NaN, and where (row 0: rank 0's under Shard(0)
# and under HSDP, whose second replica's grad stays clean).
BAD_STEP = 2
POISONED = {"fsdp": "blocks", "mesh": "hsdp.rows"}
ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_int8", "exp_avg_scales", "exp_avg_sq_root_int8",
              "exp_avg_sq_root_scales")


def expected_forms(state_dtype: str, names, off_blocks: tuple[str, ...] = ()) -> dict[str, str]:
    """The form each AdamW parameter's moments are held in with ``state_dtype``: fp32 below 2
    dims, bf16 for rows under 5 elements or a layout off the blocks under int8."""
    out = {}
    for name in names:
        shape = FSDP_CASES.get(name, MESH_CASES.get(name))
        if len(shape) < 2:
            out[name] = "float32"
        elif state_dtype == "int8" and (shape[-1] < 5 or name in off_blocks):
            out[name] = "bfloat16"
        else:
            out[name] = state_dtype
    return out


def _tensors(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(_device()) for name, shape in shapes.items()}


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _form(state: dict[str, Any], buffer: str, int8: str) -> str:
    """The dtype one moment's values are held in; under its int8 key, ``"int8"`` only if they
    are int8 (and have their scales)."""
    if int8 not in state:
        return str(state[buffer].dtype).removeprefix("torch.")
    dtype = str(state[int8].dtype).removeprefix("torch.")
    return "int8" if dtype == "int8" and int8.replace("_int8", "_scales") in state else f"{dtype} under {int8}"


def held_as(state: dict[str, Any]) -> str:
    """How a state holds its AdamW moments: ``"int8"``, ``"bfloat16"``, ``"float32"`` (both
    moments in one form; else both, joined by ``" / "``)."""
    first = _form(state, "exp_avg", "exp_avg_int8")
    second = _form(state, "exp_avg_sq", "exp_avg_sq_root_int8")
    return first if first == second else f"{first} / {second}"


def _same(mine: Any, theirs: Any) -> bool:
    if isinstance(theirs, torch.Tensor):
        mine = _whole(mine)
        return isinstance(mine, torch.Tensor) and mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    return mine == theirs


def agreement(params: dict[str, nn.Parameter], optimizer: DMuon, oracle: dict[str, nn.Parameter],
              reference: DMuon) -> dict[str, dict[str, Any]]:
    """Per parameter: whether its weights and its whole state (every key: values, scales, the
    step) equal the oracle's, bitwise (every rank takes part: whole DTensors are gathered), and
    the form an AdamW parameter's moments are held in."""
    out = {}
    for name, param in params.items():
        mine, theirs = optimizer.state[param], reference.state[oracle[name]]
        # sorted: every rank gathers the DTensors in the same order
        out[name] = {
            "weights": torch.equal(_whole(param.detach()), oracle[name].detach()),
            "state": sorted(mine) == sorted(theirs) and all(_same(mine[k], theirs[k]) for k in sorted(theirs)),
            "held_as": held_as(mine) if "exp_avg" in mine or "exp_avg_int8" in mine else "muon",
        }
    return out


def _groups(params: dict[str, nn.Parameter], state_dtype: str, off_blocks: tuple[str, ...] = ()
            ) -> list[dict[str, Any]]:
    """The Muon matrix in a Muon group; the AdamW parameters in an AdamW group with
    ``state_dtype``, the ``off_blocks`` ones in one of their own with bf16 (the oracle of a
    parameter whose layout cuts rows off the blocks)."""
    groups = [{"params": [(n, p) for n, p in params.items() if n in MUON_CASES], "use_muon": True},
              {"params": [(n, p) for n, p in params.items() if n not in MUON_CASES and n not in off_blocks],
               "use_muon": False, "state_dtype": state_dtype}]
    if any(n in off_blocks for n in params):
        groups.append({"params": [(n, p) for n, p in params.items() if n in off_blocks], "use_muon": False,
                       "state_dtype": "bfloat16"})
    return groups


def _grads(step: int, shapes: dict[str, tuple[int, ...]], poisoned: str | None = None) -> dict[str, torch.Tensor]:
    grads = _tensors(100 + step, shapes)
    if poisoned is not None:
        grads[poisoned].view(-1)[0] = float("nan")  # row 0: the first rank's block
    return grads


def _run(params: dict[str, nn.Parameter], optimizer: DMuon, shapes: dict[str, tuple[int, ...]], steps,
         place=lambda name, t: t) -> None:
    for step in steps:
        for name, grad in _grads(step, shapes).items():
            params[name].grad = place(name, grad)
        optimizer.step()


def _off_blocks(state_dtype: str) -> tuple[str, ...]:
    """The mesh cases a single process keeps in bf16 to match the ranks' fallback."""
    return OFF_BLOCKS if state_dtype == "int8" else ()


# Pieces of 400 elements (dmuon.state.kept_state.CPU_PIECE_NUMEL): 1 to 133 rows, so every rank
# and the oracle cut their rows into pieces at other places (the library's are far larger).
PIECE_NUMEL = 400


def _oracle(shapes: dict[str, tuple[int, ...]], state_dtype: str, steps, off_blocks: tuple[str, ...] = (),
            **options: Any) -> tuple[dict[str, nn.Parameter], DMuon]:
    """Single-process DMuon on the whole tensors, the steps ``steps`` (a count, or which)."""
    kept_state.CPU_PIECE_NUMEL = PIECE_NUMEL
    oracle = {n: nn.Parameter(t) for n, t in _tensors(0, shapes).items()}
    reference = DMuon(_groups(oracle, state_dtype, off_blocks), adamw_state_dtype=state_dtype, **OPTIONS, **options)
    _run(oracle, reference, shapes, range(steps) if isinstance(steps, int) else steps)
    return oracle, reference


def _on_ranks(shapes: dict[str, tuple[int, ...]], placements: Any, mesh_shape: tuple[int, ...], state_dtype: str,
              off_blocks: tuple[str, ...] = (), zeros: bool = False, **options: Any):
    """The cases as DTensors of ``placements`` (one for all, or by name) on a ``mesh_shape``
    mesh (zeros: for a checkpoint to fill), their DMuon (``options`` beside :data:`OPTIONS`),
    and how a grad is placed."""
    kept_state.CPU_PIECE_NUMEL = PIECE_NUMEL
    mesh = init_device_mesh(device_type(), mesh_shape)

    def place(name: str, t: torch.Tensor) -> torch.Tensor:
        return as_dtensor(t, mesh, placements[name] if isinstance(placements, dict) else placements)

    params = {n: nn.Parameter(place(n, torch.zeros_like(t) if zeros else t)) for n, t in _tensors(0, shapes).items()}
    optimizer = DMuon(_groups(params, state_dtype, off_blocks), adamw_state_dtype=state_dtype, **OPTIONS, **options)
    return params, optimizer, place


FSDP_SHAPES = {**FSDP_CASES, **MUON_CASES}
MESH_SHAPES = {**MESH_CASES, **MUON_CASES}


def _fsdp(state_dtype: str, zeros: bool = False, **options: Any):
    """:data:`FSDP_SHAPES` on ``Shard(0)`` over every rank (:func:`_on_ranks`)."""
    return _on_ranks(FSDP_SHAPES, [Shard(0)], (dist.get_world_size(),), state_dtype, zeros=zeros, **options)


def fsdp_exactness(state_dtype: str) -> dict[str, dict[str, Any]]:
    """``Shard(0)`` over every rank vs single process, :data:`STEPS` steps."""
    params, optimizer, place = _fsdp(state_dtype)
    _run(params, optimizer, FSDP_SHAPES, range(STEPS), place)
    return agreement(params, optimizer, *_oracle(FSDP_SHAPES, state_dtype, STEPS))


def mesh_exactness(state_dtype: str) -> dict[str, dict[str, Any]]:
    """Every mesh layout on a 2 x 2 mesh as AdamW parameters in ONE group (the ranks choose the
    bf16 fallback), vs single process (the off-block ones in a bf16 group under int8)."""
    params, optimizer, place = _on_ranks(MESH_SHAPES, MESH_PLACEMENTS, (2, 2), state_dtype)
    _run(params, optimizer, MESH_SHAPES, range(STEPS), place)
    return agreement(params, optimizer, *_oracle(MESH_SHAPES, state_dtype, STEPS, _off_blocks(state_dtype)))


# ------------------------------------------------------------------------------ DCP


def _layout(kind: str, state_dtype: str, zeros: bool = False, **options: Any):
    """``"fsdp"``: Shard(0) over every rank; ``"mesh"``: the mesh layouts on a 2 x 2 mesh (4
    ranks) or a 1 x 1 one (1 rank), in the oracle's groups. The cases and ``(params,
    optimizer, place)``."""
    if kind == "fsdp":
        return FSDP_SHAPES, _fsdp(state_dtype, zeros, **options)
    mesh_shape = (2, 2) if dist.get_world_size() == 4 else (1, 1)
    return MESH_SHAPES, _on_ranks(MESH_SHAPES, MESH_PLACEMENTS, mesh_shape, state_dtype, _off_blocks(state_dtype),
                                  zeros, **options)


def checkpoint_save(checkpoint_dir: str, kind: str, state_dtype: str, steps: int) -> None:
    """``steps`` steps of ``kind`` (:func:`_layout`), then a DCP checkpoint."""
    shapes, (params, optimizer, place) = _layout(kind, state_dtype)
    _run(params, optimizer, shapes, range(steps), place)
    save_named(checkpoint_dir, params, optimizer)


def checkpoint_resume(checkpoint_dir: str, kind: str, state_dtype: str, done: int, total: int
                      ) -> dict[str, dict[str, Any]]:
    """That checkpoint loaded on this world size (fresh weights and optimizer), steps
    ``done..total`` run, against single-process DMuon run ``total`` steps uninterrupted."""
    shapes, (params, optimizer, place) = _layout(kind, state_dtype, zeros=True)
    load_named(checkpoint_dir, params, optimizer)
    _run(params, optimizer, shapes, range(done, total), place)
    off_blocks = _off_blocks(state_dtype) if kind == "mesh" else ()
    return agreement(params, optimizer, *_oracle(shapes, state_dtype, total, off_blocks))


# ------------------------------------------------------------------------------ masks


def _bits(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value
    return (str(local.dtype), tuple(local.shape), local.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def _snapshot(optimizer: DMuon, params: dict[str, nn.Parameter]) -> dict[str, Any]:
    """Every local bit of this rank: weights and every state key."""
    found: dict[str, Any] = {name: _bits(p.detach()) for name, p in params.items()}
    for name, param in params.items():
        for key, value in optimizer.state[param].items():
            found[f"{name}/{key}"] = _bits(value)
    return found


def masked_step(kind: str, state_dtype: str) -> dict[str, Any]:
    """``kind`` (:func:`_layout`) stepped with ``skip_nonfinite``; at :data:`BAD_STEP` rank 0's grad
    of one AdamW parameter (:data:`POISONED`) holds a NaN (in rank 0's block only). Returns
    ``{"changed": the keys of this rank's bits the bad step changed (none expected),
    "skipped": the skipped-step count, "agreement": after one more step, vs single process
    that ran every step but the bad one}``."""
    shapes, (params, optimizer, place) = _layout(kind, state_dtype, skip_nonfinite=True)
    _run(params, optimizer, shapes, range(BAD_STEP), place)
    before = _snapshot(optimizer, params)
    poisoned = POISONED[kind] if dist.get_rank() == 0 else None
    for name, grad in _grads(BAD_STEP, shapes, poisoned).items():
        params[name].grad = place(name, grad)
    optimizer.step()
    optimizer.state_dict()  # settles the bad step's status (its host counters taken back)
    after = _snapshot(optimizer, params)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    skipped = optimizer.skipped_steps
    _run(params, optimizer, shapes, range(BAD_STEP + 1, BAD_STEP + 2), place)
    steps = [s for s in range(BAD_STEP + 2) if s != BAD_STEP]
    off_blocks = _off_blocks(state_dtype) if kind == "mesh" else ()
    return {"changed": changed, "skipped": skipped,
            "agreement": agreement(params, optimizer,
                                   *_oracle(shapes, state_dtype, steps, off_blocks, skip_nonfinite=True))}
