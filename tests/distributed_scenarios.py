"""Worker functions for the multi-rank tests (run by tests/multiprocess.py).

Each function runs on every rank of a gloo group, does several things, and returns
plain Python values: this rank's. A figure that differs from rank to rank (a local
shard, what this rank saw) is judged on every rank; under HSDP a rank's
``full_tensor()`` is its own replica's, so the exactness scenarios compare each rank's
local shard with the matching block of the single-process result. The tests stay one
behaviour each; the workers batch the process start-up, which dominates their cost.
"""

from __future__ import annotations

import os

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon import DMuon

STEPS = 3
# Every exactness scenario runs with each Newton-Schulz compute dtype (DMuon's ns_dtype).
NS_DTYPES = ("bfloat16", "float32")
# (name, shape, group): the cases the exactness tests name. Rows are chosen so that
# 4 ranks give uneven and empty shards: 10 rows -> 3,3,3,1; 3 rows -> 1,1,1,0.
CASES: list[tuple[str, tuple[int, ...], str]] = [
    ("square", (32, 32), "muon_a"),
    ("tall", (48, 16), "muon_a"),
    ("wide", (16, 48), "muon_b"),
    ("uneven", (10, 24), "muon_b"),
    ("empty_shard", (3, 8), "muon_a"),
    ("experts_3d", (3, 8, 12), "muon_b"),
    ("norm.weight", (24,), "adamw"),
    ("tok_embeddings.weight", (50, 16), "adamw"),
]
# The two Muon groups also use the two kinds of coefficient schedule: a named one with
# its own normalization, and a per-iteration list (shorter than ns_steps: the last repeats).
GROUP_OPTIONS = {
    "muon_a": {"use_muon": True, "lr": 0.05, "momentum": 0.95, "ns_coefficients": "polar_express"},
    "muon_b": {"use_muon": True, "lr": 0.02, "momentum": 0.9, "weight_decay": 0.1,
               "ns_coefficients": [(3.4445, -4.7750, 2.0315), (3.0, -3.2, 1.2)]},
    "adamw": {"use_muon": False, "lr": 0.01},
}


def device_type() -> str:
    """Where this group's tensors live: "cuda" under NCCL (tests/test_cuda.py), else "cpu";
    ``DMUON_SCENARIO_DEVICE=cuda`` puts a gloo group's on the GPU (two ranks on one GPU,
    ``benchmarks.gpu_check two_ranks``: NCCL refuses that)."""
    return "cuda" if dist.get_backend() == "nccl" else os.environ.get("DMUON_SCENARIO_DEVICE", "cpu")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")


def _case_tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(_device()) for name, shape, _ in CASES}


def _groups(params: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [
        {"params": [(name, params[name]) for name, _, g in CASES if g == group], **options}
        for group, options in GROUP_OPTIONS.items()
    ]


def _run(params: dict[str, torch.Tensor], grads_for_step, **kwargs: Any) -> DMuon:
    optimizer = DMuon(_groups(params), weight_decay=0.01, **kwargs)
    for step in range(STEPS):
        for name, grad in grads_for_step(step).items():
            params[name].grad = grad
        optimizer.step()
    return optimizer


def single_process_params(ns_dtype: str, ns_algorithm: str = "standard") -> dict[str, torch.Tensor]:
    """The oracle: DMuon on full plain tensors, in this process, one thread."""
    params = {n: nn.Parameter(t) for n, t in _case_tensors(0).items()}
    _run(params, lambda step: _case_tensors(100 + step), ns_dtype=ns_dtype, ns_algorithm=ns_algorithm)
    return {n: p.detach() for n, p in params.items()}


def per_ns_dtype(scenario: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``{ns_dtype: scenario(*args, ns_dtype=ns_dtype)}`` for each of NS_DTYPES, in one launch."""
    return {ns_dtype: scenario(*args, ns_dtype=ns_dtype) for ns_dtype in NS_DTYPES}


def exactness_layouts(world: int) -> dict[str, tuple[Any, list]]:
    """Layout name -> (mesh, placements) the exactness scenarios run: Shard(0) over every
    rank, and at 4 ranks HSDP and FSDP + TP on a 2 x 2 mesh."""
    layouts = {"fsdp": (init_device_mesh(device_type(), (world,)), [Shard(0)])}
    if world == 4:
        mesh_2d = init_device_mesh(device_type(), (2, 2))
        layouts["hsdp"] = (mesh_2d, [Replicate(), Shard(0)])
        layouts["fsdp_tp"] = (mesh_2d, [_StridedShard(0, split_factor=2), Shard(0)])
    return layouts


EXCHANGE_PATHS = ("all_to_all", "redistribute")


def exactness_runs(layouts: dict[str, tuple[Any, list]]) -> Iterator[tuple[str, str, Callable[[torch.Tensor], DTensor]]]:
    """Every (layout, comm) pair the exactness scenarios check, with the function that
    shards a full tensor onto that layout."""
    for layout, (mesh, placements) in layouts.items():
        def shard(t: torch.Tensor, mesh=mesh, placements=placements) -> DTensor:
            return distribute_tensor(t, mesh, placements, src_data_rank=None)

        for comm in EXCHANGE_PATHS:
            yield layout, comm, shard


def exactness(ns_dtype: str = "auto", ns_algorithm: str = "standard") -> dict[Any, Any]:
    """Fast and reference paths on Shard(0) (and 2-D meshes at 4 ranks) vs the oracle.
    The distributed runs step their elementwise rules as list ops (``foreach=True``),
    the oracle per tensor (the CPU default), so equality also says the two agree.

    Returns this rank's ``{(layout, comm): {case: its local shard is bitwise the
    oracle's block}}`` plus paths and byte counts.
    """
    world = dist.get_world_size()
    oracle = single_process_params(ns_dtype, ns_algorithm)
    layouts = exactness_layouts(world)
    out: dict[Any, Any] = {}
    for layout, comm, shard in exactness_runs(layouts):
        params = {n: nn.Parameter(shard(t)) for n, t in _case_tensors(0).items()}
        optimizer = _run(params, lambda step: {n: shard(t) for n, t in _case_tensors(100 + step).items()}, comm=comm,
                         ns_dtype=ns_dtype, ns_algorithm=ns_algorithm, foreach=True)
        out[(layout, comm)] = local_shards_equal(params, oracle, shard)
        out[(layout, comm, "paths")] = optimizer.comm_paths()
        out[(layout, comm, "bytes")] = optimizer.comm_stats.bytes_sent
        out[(layout, comm, "local_rows")] = {n: p.to_local().shape[0] for n, p in params.items()}
        out[(layout, comm, "checksum")] = sum(p.full_tensor().double().sum().item() for p in params.values())
    return out


def local_shards_equal(params: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor],
                       shard: Callable[[torch.Tensor], DTensor]) -> dict[str, bool]:
    """Per parameter: whether this rank's local shard is bitwise the block of the
    single-process tensor that ``shard`` lays on this rank (no collective)."""
    return {n: torch.equal(params[n].to_local(), shard(oracle[n].detach()).to_local()) for n in oracle}


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 24, hidden: int = 40) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.output(self.norm(h))


# What fsdp2_training reports on: _TinyLM's parameters (fully_shard keeps their names).
TINY_LM_PARAMS = frozenset({"tok_embeddings.weight", "up.weight", "down.weight", "norm.weight", "norm.bias",
                            "output.weight"})


def fsdp2_training() -> dict[str, bool]:
    """A real fully_shard model trained a few steps vs the oracle on the gathered grads."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    torch.manual_seed(0)
    reference = _TinyLM().to(_device())
    model = _TinyLM().to(_device())
    model.load_state_dict(reference.state_dict())
    fully_shard(model, mesh=init_device_mesh(device_type(), (world,)))
    sharded_opt = DMuon(model.named_parameters(), lr=0.03, weight_decay=0.1)
    reference_opt = DMuon(reference.named_parameters(), lr=0.03, weight_decay=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        tokens = torch.randint(0, 40, (2, 8), generator=generator).to(_device())
        model(tokens).logsumexp(-1).mean().backward()
        full_grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        for name, param in reference.named_parameters():
            param.grad = full_grads[name]
        sharded_opt.step()
        reference_opt.step()
        sharded_opt.zero_grad()
    return {n: torch.equal(p.full_tensor(), dict(reference.named_parameters())[n].detach())
            for n, p in model.named_parameters()}


def _sharded_model(world: int, seed: int = 0) -> tuple[dict[str, nn.Parameter], Any]:
    mesh = init_device_mesh(device_type(), (world,))
    return ({n: nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None))
             for n, t in _case_tensors(seed).items()}, mesh)


def _set_grads(params: dict[str, nn.Parameter], mesh: Any, seed: int) -> None:
    for name, full in _case_tensors(seed).items():
        params[name].grad = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)


def _local_snapshot(params: dict[str, nn.Parameter], optimizer: DMuon, muon_only: bool = False,
                    names: tuple[str, ...] | None = None) -> dict:
    """This rank's bytes of every (Muon; named) parameter and its state, read without a collective."""
    muon = {p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    snap = {}
    for name, param in params.items():
        if (muon_only and param not in muon) or (names is not None and name not in names):
            continue
        snap[name] = param.detach().to_local().clone().view(-1).view(torch.uint8).tolist()
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                snap[name, key] = (value.to_local() if isinstance(value, DTensor) else value).clone().reshape(-1).view(
                    torch.uint8).tolist()
    return snap


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test reads the type and message
        return f"{type(error).__name__}: {error}"
    return None


def robustness() -> dict[str, Any]:
    """None grads, disagreeing ranks, invalid grads, NaN, and the zero-grad lr=0 step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}

    # A grad that is None on every rank is skipped: no change, no state, no hang.
    params, mesh = _sharded_model(world)
    optimizer = DMuon(_groups(params))
    before = params["wide"].detach().full_tensor().clone()
    _set_grads(params, mesh, 1)
    params["wide"].grad = None
    optimizer.step()
    out["none_everywhere_unchanged"] = torch.equal(params["wide"].full_tensor(), before)
    out["none_everywhere_no_state"] = params["wide"] not in optimizer.state
    out["none_everywhere_others_stepped"] = "momentum_buffer" in optimizer.state[params["square"]]

    # Ranks that disagree: that step writes nothing on any rank (no parameter moves), and
    # every rank raises the same clear error at the next step, which leaves everything,
    # state keys included, as it was before the disagreeing step.
    _set_grads(params, mesh, 2)
    if rank == 0:
        params["uneven"].grad = None
    before_all = _local_snapshot(params, optimizer)
    params_before = {n: p.detach().to_local().clone() for n, p in params.items()}
    out["disagree_step"] = _error(optimizer.step)
    out["disagree_unchanged"] = all(torch.equal(p.to_local(), params_before[n]) for n, p in params.items())
    _set_grads(params, mesh, 3)
    out["disagree_error"] = _error(optimizer.step)
    out["disagree_error_unchanged"] = _local_snapshot(params, optimizer) == before_all

    # An invalid grad on one rank only: that rank raises its own message at once, after
    # the collectives; every rank raises at the next step; nothing changed anywhere.
    _set_grads(params, mesh, 4)
    if rank == world - 1:
        local = params["square"].grad.to_local()
        params["square"].grad_dtype = None  # let autograd's dtype check through
        params["square"].grad = DTensor.from_local(local.to(torch.complex64), mesh, [Shard(0)], run_check=False)
    before = _local_snapshot(params, optimizer)
    params_before = {n: p.detach().to_local().clone() for n, p in params.items()}
    out["invalid_step"] = _error(optimizer.step)
    out["invalid_unchanged"] = all(torch.equal(p.to_local(), params_before[n]) for n, p in params.items())
    _set_grads(params, mesh, 5)
    out["invalid_error"] = _error(optimizer.step)
    out["invalid_all_unchanged"] = _local_snapshot(params, optimizer) == before

    # The optimizer is still usable afterwards (no collective was left half done).
    _set_grads(params, mesh, 6)
    out["usable_after_errors"] = _error(optimizer.step) is None

    # NaN in one rank's shard: no hang; that matrix becomes NaN everywhere, others stay finite.
    params, mesh = _sharded_model(world)
    optimizer = DMuon(_groups(params))
    _set_grads(params, mesh, 5)
    if rank == 0:
        params["tall"].grad.to_local()[0, 0] = float("nan")
    out["nan_error"] = _error(optimizer.step)
    out["nan_matrix_all_nan"] = bool(params["tall"].full_tensor().isnan().all())
    out["nan_others_finite"] = all(bool(p.full_tensor().isfinite().all()) for n, p in params.items() if n != "tall")

    # The step DCP runs to create state: zero grads, lr = 0.
    params, mesh = _sharded_model(world)
    optimizer = DMuon(_groups(params))
    before = {n: p.detach().full_tensor().clone() for n, p in params.items()}
    for param in params.values():
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    out["lr0_unchanged"] = all(torch.equal(p.full_tensor(), before[n]) for n, p in params.items())
    out["lr0_state_keys"] = {n: sorted(optimizer.state[p]) for n, p in params.items()}
    out["lr0_state_placements"] = {
        n: [str(v.placements) for k, v in sorted(optimizer.state[p].items()) if isinstance(v, DTensor)]
        for n, p in params.items()
    }
    out["lr0_state_finite"] = all(
        bool(v.full_tensor().isfinite().all()) for p in params.values() for v in optimizer.state[p].values()
        if isinstance(v, DTensor)
    )
    return out


def state_dict_resume() -> dict[str, bool]:
    """state_dict / load_state_dict and DCP save/load resume bitwise like an uninterrupted run."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    world = dist.get_world_size()
    out: dict[str, bool] = {}

    # Uninterrupted: 4 steps.
    params, mesh = _sharded_model(world)
    optimizer = DMuon(_groups(params))
    for step in range(4):
        _set_grads(params, mesh, 10 + step)
        optimizer.step()
    uninterrupted = {n: p.full_tensor() for n, p in params.items()}

    def resumed(load) -> dict[str, torch.Tensor]:
        params, mesh = _sharded_model(world)
        optimizer = DMuon(_groups(params))
        for step in range(2):
            _set_grads(params, mesh, 10 + step)
            optimizer.step()
        new_params = {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}
        new_optimizer = DMuon(_groups(new_params))
        load(params, optimizer, new_params, new_optimizer)
        for step in range(2, 4):
            _set_grads(new_params, mesh, 10 + step)
            new_optimizer.step()
        return {n: p.full_tensor() for n, p in new_params.items()}

    def plain(_old_params, old, _new_params, new) -> None:
        new.load_state_dict(old.state_dict())

    def as_module(params: dict[str, nn.Parameter]) -> nn.Module:
        return nn.ParameterDict({n.replace(".", "_"): p for n, p in params.items()})

    checkpoint_dir = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(checkpoint_dir, src=0)

    def through_dcp(old_params, old, new_params, new) -> None:
        dcp.save({"optim": get_optimizer_state_dict(as_module(old_params), old)}, checkpoint_id=checkpoint_dir[0])
        # A fresh optimizer has no state: this runs DCP's zero-grad, lr = 0 step.
        target = {"optim": get_optimizer_state_dict(as_module(new_params), new)}
        dcp.load(target, checkpoint_id=checkpoint_dir[0])
        set_optimizer_state_dict(as_module(new_params), new, target["optim"])

    out["state_dict"] = all(torch.equal(t, uninterrupted[n]) for n, t in resumed(plain).items())
    out["dcp"] = all(torch.equal(t, uninterrupted[n]) for n, t in resumed(through_dcp).items())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(checkpoint_dir[0], ignore_errors=True)
    return out


def copies_step_like_the_original() -> dict[str, dict[str, bool]]:
    """A DMuon on Shard(0) DTensors, deep-copied and pickled after a step (its paths and
    owner plan built), then the original and each copy stepped twice with the same
    grads: ``{copy: {"params": ..., "state": ...}}``, whether this rank's local shards of
    every parameter and of every state tensor equal the original's, bitwise. A copy that
    shared a parameter with the original would step it twice."""
    import copy
    import pickle

    world = dist.get_world_size()
    params, mesh = _sharded_model(world)
    original = DMuon(_groups(params))
    _set_grads(params, mesh, 1)
    original.step()
    optimizers = {"original": original, "deepcopy": copy.deepcopy(original),
                  "pickle": pickle.loads(pickle.dumps(original))}
    for step in (2, 3):
        for optimizer in optimizers.values():
            _set_grads(_params_by_name(optimizer), mesh, step)
            optimizer.step()

    def local(t: Any) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def agree(optimizer: DMuon) -> dict[str, bool]:
        mine, theirs = _params_by_name(optimizer), _params_by_name(original)
        return {
            "params": mine.keys() == theirs.keys() and all(
                torch.equal(local(p), local(theirs[n])) for n, p in mine.items()),
            "state": all(
                optimizer.state[p].keys() == original.state[theirs[n]].keys() > set() and all(
                    torch.equal(local(v), local(original.state[theirs[n]][k])) for k, v in optimizer.state[p].items())
                for n, p in mine.items()),
        }

    return {name: agree(optimizer) for name, optimizer in optimizers.items() if optimizer is not original}


def _params_by_name(optimizer: DMuon) -> dict[str, nn.Parameter]:
    return {optimizer.param_name(p): p for group in optimizer.param_groups for p in group["params"]}


def path_log() -> list[str]:
    """The log lines DMuon emits over two steps (paths and the compute dtype)."""
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("dmuon")
    logger.addHandler(Capture())
    logger.setLevel(logging.INFO)
    world = dist.get_world_size()
    params, mesh = _sharded_model(world)
    # Columns of a 2-D weight are blocks (fast path); a 4-D filter cut past dim 0 is not.
    col_sharded = nn.Parameter(distribute_tensor(torch.randn(8, 6, device=_device()), mesh, [Shard(1)], src_data_rank=None))
    conv = nn.Parameter(distribute_tensor(torch.randn(4, 6, 3, 3, device=_device()), mesh, [Shard(1)], src_data_rank=None))
    optimizer = DMuon([*_groups(params), {"params": [("col_sharded", col_sharded), ("conv", conv)], "use_muon": True}])
    for seed in (1, 2):
        _set_grads(params, mesh, seed)
        for param in (col_sharded, conv):
            param.grad = distribute_tensor(torch.randn(param.shape, device=_device()), mesh, [Shard(1)],
                                           src_data_rank=None)
        optimizer.step()
    return records


def small_benchmark(json_path: str, **options: Any) -> dict[str, Any]:
    """benchmarks.bench end to end on a tiny stack (structure, not speed)."""
    from benchmarks.bench import BenchConfig, run_benchmark

    # float32 and bf16_rows: the dmuon_bf16 and vanilla rows run too, on any CPU.
    options = {"ns_dtype": "float32", "bf16_rows": True} | options
    return run_benchmark(BenchConfig(dim=64, layers=2, steps=1, warmup=1, json=json_path, **options))


def bf16_benchmark(json_path: str) -> dict[str, Any]:
    """dmuon and dmuon_bf16 asked for, with ns_dtype already bfloat16."""
    return small_benchmark(json_path, optimizers=("dmuon", "dmuon_bf16"), ns_dtype="bfloat16")


def small_batches_benchmark(json_path: str) -> dict[str, Any]:
    """dmuon alone, with batches of one matrix per rank."""
    return small_benchmark(json_path, optimizers=("dmuon",), max_batch_numel=1)


def custom_uneven_shards() -> str | None:
    """Shard(0) DTensors whose rows are not torch.chunk's split: every rank raises."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device_type(), (world,))
    rows = 1 if rank == 0 else 5  # torch.chunk would give 3, 3 for 6 rows on 2 ranks
    local = torch.randn(rows, 4, device=_device())
    param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size([6, 4]), stride=(4, 1)))
    param.grad = DTensor.from_local(torch.randn(rows, 4, device=_device()), mesh, [Shard(0)], shape=torch.Size([6, 4]), stride=(4, 1))
    return _error(DMuon([{"params": [("odd", param)], "use_muon": True}]).step)


# The steps of collective_sequences, and what each does to one copy's grads (the twin's stay clean).
SEQUENCE_STEPS = ("clean", "none_everywhere", "nan_on_rank_0", "none_on_rank_0", "raises_disagree",
                  "complex_on_last_rank_partial_adamw", "raises_invalid", "clean_again")
# Steps whose collectives must be a clean step's (the others raise before their first one).
SEQUENCE_LIKE_CLEAN = ("none_everywhere", "nan_on_rank_0", "none_on_rank_0", "complex_on_last_rank_partial_adamw",
                       "clean_again")


def backend_collectives(prof: Any) -> list[tuple[str, tuple[str, ...], tuple[tuple[int, ...], ...]]]:
    """The backend's own collective calls a profile saw, in start order: (name, dtypes,
    shapes), e.g. ``("gloo:all_reduce", ("int",), ((7,),))``; DTensor's functional
    collectives included (they run on the same backend)."""
    backend = f"{dist.get_backend()}:"
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name().startswith(backend)),
                    key=lambda e: e.start_ns())
    return [(e.name(), tuple(str(d) for d in e.dtypes()), tuple(tuple(s) for s in e.shapes())) for e in events]


def across_ranks(sequence: list) -> list:
    """What every rank of a group must run alike: an all-to-all's sizes are its own split
    (they differ from rank to rank), every other collective's sizes must match."""
    return [(name, dtypes, None if "all_to_all" in name else shapes) for name, dtypes, shapes in sequence]


def collective_sequences() -> dict[str, list]:
    """The backend collectives one rank runs in each of SEQUENCE_STEPS, with dtypes and
    sizes, on a DMuon whose grads go wrong on some ranks only, and on a twin with clean
    grads (``{"steps": [...], "twin": [...]}``, one list per step). Uneven and empty shards,
    a grad None everywhere, a NaN in one rank's shard, a grad missing on one rank, an invalid
    grad on another with a ``Partial`` AdamW grad on every rank (DTensor's own reduction)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    params, mesh = _sharded_model(world)
    twin_params, _ = _sharded_model(world)
    optimizer, twin = DMuon(_groups(params)), DMuon(_groups(twin_params))
    out: dict[str, list] = {"steps": [], "twin": []}
    for step, what in enumerate(SEQUENCE_STEPS):
        for copy, opt, key in ((params, optimizer, "steps"), (twin_params, twin, "twin")):
            _set_grads(copy, mesh, 20 + step)
            if what == "complex_on_last_rank_partial_adamw":
                full = _case_tensors(20 + step)["norm.weight"]
                mine = full if rank == 0 else torch.zeros_like(full)  # sums to the full grad exactly
                copy["norm.weight"].grad = DTensor.from_local(mine, mesh, [Partial()], run_check=False)
            if key == "steps":
                _spoil(what, copy, mesh, rank, world)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                _error(opt.step)
            out[key].append(backend_collectives(prof))
    return out


def _spoil(what: str, params: dict[str, nn.Parameter], mesh: Any, rank: int, world: int) -> None:
    """The rank-asymmetric part of a SEQUENCE_STEPS step."""
    if what == "none_everywhere":
        params["wide"].grad = None
    elif what == "nan_on_rank_0" and rank == 0:
        params["tall"].grad.to_local()[0, 0] = float("nan")
    elif what == "none_on_rank_0" and rank == 0:
        params["uneven"].grad = None
    elif what == "complex_on_last_rank_partial_adamw" and rank == world - 1:
        params["square"].grad_dtype = None
        local = params["square"].grad.to_local().to(torch.complex64)
        params["square"].grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)


# (name, shape, shard_dim): layouts the scale-out plan must keep exact.
LAYOUT_CASES: list[tuple[str, tuple[int, ...], int]] = [
    ("rows", (10, 24), 0),
    ("tall", (48, 16), 0),
    ("columns", (16, 10), 1),  # TP row-parallel weight: Shard(1)
    ("experts_whole", (4, 8, 12), 0),  # each expert whole on one rank
    ("experts_split_rows", (3, 10, 12), 1),  # each expert's rows split across ranks
    ("experts_split_cols", (2, 8, 10), 2),
]


def _layout_tensors(seed: int, cases: list[tuple[str, tuple[int, ...], int]]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(_device()) for name, shape, _ in cases}


# Attention-like weights orthogonalized per head (split_rows=4): 20 rows on 4 ranks are
# 5, 5, 5, 5, so heads [4, 8) and [8, 12) straddle two ranks each.
HEAD_CASES: list[tuple[str, tuple[int, ...], int]] = [
    ("heads_rows", (20, 12), 0),
    ("heads_cols", (12, 20), 1),
]


def layout_exactness(case_names: list[str], max_batch_numel: int, split_rows: int | None = None,
                     ns_dtype: str = "auto", ns_algorithm: str = "standard") -> dict[str, Any]:
    """The cases named (from LAYOUT_CASES and HEAD_CASES), each sharded on its dim, vs
    single-process DMuon with the same options; plus paths, bytes and batches."""
    world = dist.get_world_size()
    cases = [c for c in LAYOUT_CASES + HEAD_CASES if c[0] in case_names]
    mesh = init_device_mesh(device_type(), (world,))
    options = dict(lr=0.03, momentum=0.9, weight_decay=0.05, max_batch_numel=max_batch_numel, split_rows=split_rows,
                   ns_dtype=ns_dtype, ns_algorithm=ns_algorithm)

    def shard(name: str, t: torch.Tensor) -> DTensor:
        dim = next(d for n, _, d in cases if n == name)
        return distribute_tensor(t, mesh, [Shard(dim)], src_data_rank=None)

    params = {n: nn.Parameter(shard(n, t)) for n, t in _layout_tensors(0, cases).items()}
    oracle = {n: nn.Parameter(t) for n, t in _layout_tensors(0, cases).items()}
    optimizer = DMuon([{"params": list(params.items()), "use_muon": True}], **options)
    reference = DMuon([{"params": list(oracle.items()), "use_muon": True}], **options)
    for step in range(STEPS):
        for name, grad in _layout_tensors(100 + step, cases).items():
            params[name].grad = shard(name, grad)
            oracle[name].grad = grad
        optimizer.step()
        reference.step()
    (plan,) = optimizer.owner_plans() or (None,)
    return {
        "equal": {n: torch.equal(p.full_tensor(), oracle[n].detach()) for n, p in params.items()},
        "paths": optimizer.comm_paths(),
        "bytes": optimizer.comm_stats.bytes_sent,
        "batches": [] if plan is None else [list(b) for b in plan.batches],
        "idle_in_some_batch": plan is not None and any(
            plan.ns_flops(r, b) == 0 for b in plan.batches for r in range(world)
        ),
        "ns_flops": optimizer.comm_stats.ns_flops,
    }


def measured_scratch(max_batch_numel: int) -> dict[str, int]:
    """The scratch a real step allocates on this rank vs what its plan predicts."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = LAYOUT_CASES
    mesh = init_device_mesh(device_type(), (world,))
    params = {n: nn.Parameter(distribute_tensor(t, mesh, [Shard(d)], src_data_rank=None))
              for (n, _, d), t in zip(cases, _layout_tensors(0, cases).values())}
    optimizer = DMuon([{"params": list(params.items()), "use_muon": True}], max_batch_numel=max_batch_numel)
    peaks = []
    for step in range(2):
        for (name, _, dim), grad in zip(cases, _layout_tensors(10 + step, cases).values()):
            params[name].grad = distribute_tensor(grad, mesh, [Shard(dim)], src_data_rank=None)
        optimizer.step()
        peaks.append(optimizer.scratch_stats.peak_bytes)
    (plan,) = optimizer.owner_plans()
    return {"measured": peaks, "predicted": plan.peak_scratch_bytes(rank), "live_after": optimizer.scratch_stats.live_bytes}


def comm_paths_on_one_rank() -> dict[str, str]:
    """Logging code often asks rank 0 alone: the query must not run a collective."""
    params, mesh = _sharded_model(dist.get_world_size())
    optimizer = DMuon(_groups(params))
    paths = optimizer.comm_paths() if dist.get_rank() == 0 else {}
    dist.barrier()  # any collective the query ran would now be unmatched
    _set_grads(params, mesh, 1)
    optimizer.step()
    return paths


def sparse_grad_on_one_rank() -> dict[str, Any]:
    """A sparse grad (an embedding's, a plain tensor: a DTensor cannot hold one) on rank 0
    only: rank 0 raises at once, after the collectives; the step moves no Muon parameter on
    any rank; every rank raises at the next step; then the optimizer works again."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device_type(), (world,))
    w = nn.Parameter(distribute_tensor(torch.randn(8, 6, device=_device()), mesh, [Shard(0)], src_data_rank=None))
    emb = nn.Parameter(torch.randn(10, 4, device=_device()))
    optimizer = DMuon([{"params": [("w", w)], "use_muon": True}, {"params": [("emb", emb)], "use_muon": False}])

    def grads(seed: int, sparse: bool) -> None:
        w.grad = distribute_tensor(torch.randn(8, 6, device=_device()), mesh, [Shard(0)], src_data_rank=None)
        dense = torch.randn(10, 4, device=_device(), generator=torch.Generator(_device()).manual_seed(seed))
        emb.grad = dense.to_sparse() if sparse else dense

    grads(0, False)
    optimizer.step()
    before = (w.to_local().clone(), optimizer.state[w]["momentum_buffer"].to_local().clone())
    grads(1, sparse=rank == 0)
    out = {"step": _error(optimizer.step)}
    out["unchanged"] = all(torch.equal(a, b) for a, b in
                           zip(before, (w.to_local(), optimizer.state[w]["momentum_buffer"].to_local())))
    grads(2, False)
    out["next"] = _error(optimizer.step)
    grads(3, False)
    out["after"] = _error(optimizer.step)
    return out


def invalid_grad_with_two_meshes() -> str | None:
    """4 ranks as a 2 x 2 grid: parameter ``a`` lives on this rank's row (a 1-D
    sub-mesh: ranks {0, 1} or {2, 3}), ``b`` on the whole grid. Rank 3 finds an invalid
    grad for ``a``. Ranks 0 and 1 learn of it only through the grid's agreement, so
    every rank must run that one too before anyone raises."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = init_device_mesh(device_type(), (2, world // 2), mesh_dim_names=("column", "row"))
    flat = grid["row"]
    a = nn.Parameter(distribute_tensor(torch.randn(8, 6, device=_device()), flat, [Shard(0)], src_data_rank=None))
    b = nn.Parameter(distribute_tensor(torch.randn(8, 6, device=_device()), grid, [Replicate(), Shard(0)],
                                       src_data_rank=None))
    optimizer = DMuon([{"params": [("a", a), ("b", b)], "use_muon": True}])
    a.grad = distribute_tensor(torch.randn(8, 6, device=_device()), flat, [Shard(0)], src_data_rank=None)
    b.grad = distribute_tensor(torch.randn(8, 6, device=_device()), grid, [Replicate(), Shard(0)], src_data_rank=None)
    if rank == world - 1:
        a.grad_dtype = None
        a.grad = DTensor.from_local(a.grad.to_local().to(torch.complex64), flat, [Shard(0)], run_check=False)
    first = _error(optimizer.step)
    a.grad = distribute_tensor(torch.randn(8, 6, device=_device()), flat, [Shard(0)], src_data_rank=None)
    return [first, _error(optimizer.step)]


# Six 8 x 16 matrices row-sharded over 2 ranks, and a batch cap of one matrix per
# owner: the plan has three batches, so one batch runs with a gather and a scatter
# in flight on both sides of it.
SCHEDULE_SHAPES = [(8, 16)] * 6
SCHEDULE_BATCH_NUMEL = 8 * 16


def owner_exchange_collectives() -> list[tuple[str, int]]:
    """The owner exchange's collectives in one real step, in the order this rank
    started (``("start", k)``: the k-th ``Exchange`` made) and waited for them
    (``("wait", k)``), recorded by wrapping ``dmuon.exchange.comm.Exchange``."""
    from dmuon.exchange.comm import Exchange

    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(shape, generator=generator) for shape in SCHEDULE_SHAPES]
    params = [nn.Parameter(distribute_tensor(t.to(_device()), mesh, [Shard(0)], src_data_rank=None)) for t in full]
    for param, tensor in zip(params, full):
        param.grad = distribute_tensor(tensor.to(_device()).flip(0), mesh, [Shard(0)], src_data_rank=None)
    optimizer = DMuon([{"params": [(f"w{i}", p) for i, p in enumerate(params)], "use_muon": True}],
                      max_batch_numel=SCHEDULE_BATCH_NUMEL)
    events: list[tuple[str, int]] = []
    started = Exchange.__init__
    wait = Exchange.wait

    def recording_start(self, *args: Any, **kwargs: Any) -> None:
        started(self, *args, **kwargs)
        self.schedule_index = sum(kind == "start" for kind, _ in events)
        events.append(("start", self.schedule_index))

    def recording_wait(self) -> torch.Tensor:
        events.append(("wait", self.schedule_index))
        return wait(self)

    Exchange.__init__, Exchange.wait = recording_start, recording_wait
    try:
        optimizer.step()
    finally:
        Exchange.__init__, Exchange.wait = started, wait
    return events


# ---------------------------------------------------------------- update-rule variants (issue 16)
# The exactness cases again, with NorMuon and cautious weight decay on: one Muon group
# with both, one with NorMuon only, and cautious decay in the AdamW group.
VARIANT_OPTIONS = {
    "muon_a": {**GROUP_OPTIONS["muon_a"], "normuon": True, "cautious_weight_decay": True},
    "muon_b": {**GROUP_OPTIONS["muon_b"], "normuon": True, "normuon_beta2": 0.9},
    "adamw": {**GROUP_OPTIONS["adamw"], "cautious_weight_decay": True},
}


def _variant_groups(params: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [
        {"params": [(name, params[name]) for name, _, g in CASES if g == group], **options}
        for group, options in VARIANT_OPTIONS.items()
    ]


def _variant_steps(optimizer: DMuon, params: dict[str, torch.Tensor], steps: range, shard=lambda t: t) -> None:
    for step in steps:
        for name, grad in _case_tensors(100 + step).items():
            params[name].grad = shard(grad)
        optimizer.step()


def variants_exactness(ns_dtype: str = "auto") -> dict[Any, Any]:
    """NorMuon and cautious weight decay, both paths, vs single-process DMuon with the
    same groups, on the layouts of :func:`exactness` (Shard(0) over every rank; HSDP and
    FSDP + TP on a 2 x 2 mesh at 4 ranks): this rank's ``{(layout, comm): {case: its
    local shard is bitwise the oracle's block}}``, and ``{(layout, comm, "moments"):
    {case: every rank's NorMuon state equals the oracle's}}``.
    As in :func:`exactness`, the distributed runs use list ops, the oracle per tensor."""
    world = dist.get_world_size()
    oracle = {n: nn.Parameter(t) for n, t in _case_tensors(0).items()}
    reference = DMuon(_variant_groups(oracle), weight_decay=0.01, ns_dtype=ns_dtype)
    _variant_steps(reference, oracle, range(STEPS))
    layouts = exactness_layouts(world)
    out: dict[Any, Any] = {}
    for layout, comm, shard in exactness_runs(layouts):
        params = {n: nn.Parameter(shard(t)) for n, t in _case_tensors(0).items()}
        optimizer = DMuon(_variant_groups(params), weight_decay=0.01, ns_dtype=ns_dtype, comm=comm, foreach=True)
        _variant_steps(optimizer, params, range(STEPS), shard)
        out[(layout, comm)] = local_shards_equal(params, oracle, shard)
        out[(layout, comm, "paths")] = optimizer.comm_paths()
        out[(layout, comm, "moments")] = normuon_states_agree(
            {n: optimizer.state[params[n]] for n in oracle}, {n: reference.state[oracle[n]] for n in oracle})
    for comm in EXCHANGE_PATHS:
        out[("split_rows", comm)] = _normuon_split_rows_exactness(layouts["fsdp"][0], comm, ns_dtype)
    return out


# Attention-like weights orthogonalized per block of 4 rows (``split_rows``): 12 rows cut
# 3 per rank at 4 ranks, so shards cut through the blocks and NorMuon's state rows.
SPLIT_ROWS_CASES = {"heads": (12, 8), "heads_wide": (8, 20)}
SPLIT_ROWS_OPTIONS = {"use_muon": True, "split_rows": 4, "normuon": True, "cautious_weight_decay": True,
                      "weight_decay": 0.1}


def _normuon_split_rows_exactness(mesh: Any, comm: str, ns_dtype: str) -> dict[str, bool]:
    """NorMuon with ``split_rows`` on Shard(0) over ``mesh`` vs single process: per
    parameter, whether its weights and every rank's NorMuon state are bitwise equal."""
    def tensors(seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {n: torch.randn(shape, generator=generator).to(_device()) for n, shape in SPLIT_ROWS_CASES.items()}

    def shard(t: torch.Tensor) -> DTensor:
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    oracle = {n: nn.Parameter(t) for n, t in tensors(0).items()}
    params = {n: nn.Parameter(shard(t)) for n, t in tensors(0).items()}
    reference = DMuon([{"params": list(oracle.items()), **SPLIT_ROWS_OPTIONS}], ns_dtype=ns_dtype)
    optimizer = DMuon([{"params": list(params.items()), **SPLIT_ROWS_OPTIONS}], ns_dtype=ns_dtype, comm=comm)
    for step in range(STEPS):
        for name, grad in tensors(100 + step).items():
            oracle[name].grad, params[name].grad = grad, shard(grad)
        reference.step()
        optimizer.step()
    moments = normuon_states_agree({n: optimizer.state[p] for n, p in params.items()},
                                   {n: reference.state[p] for n, p in oracle.items()})
    return {n: torch.equal(p.full_tensor(), oracle[n].detach()) and moments[n] for n, p in params.items()}


def normuon_states_agree(states: dict[str, dict[str, Any]], oracle_states: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Per NorMuon parameter: whether every rank's copy of its ``normuon_second_moment``
    (replicated, so each rank holds all of it) equals the single-process state."""
    agree = {}
    for name, oracle_state in oracle_states.items():
        if "normuon_second_moment" not in oracle_state:
            continue
        mine = states[name]["normuon_second_moment"].to_local()
        copies = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, mine)
        agree[name] = all(torch.equal(c, oracle_state["normuon_second_moment"]) for c in copies)
    return agree


def variants_checkpoint_save(checkpoint_dir: str, steps: int) -> None:
    """``steps`` steps with the variant groups on Shard(0) over every rank, then a DCP
    checkpoint of the parameters and the optimizer (NorMuon state included)."""
    from tests.named_checkpoints import save_named

    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))

    def shard(t: torch.Tensor) -> DTensor:
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    params = {n: nn.Parameter(shard(t)) for n, t in _case_tensors(0).items()}
    optimizer = DMuon(_variant_groups(params), weight_decay=0.01, ns_dtype="float32")
    _variant_steps(optimizer, params, range(steps), shard)
    save_named(checkpoint_dir, params, optimizer)


def variants_checkpoint_resume(checkpoint_dir: str, done: int, total: int) -> dict[str, bool]:
    """Load that checkpoint on this world size (fresh parameters and optimizer), run
    steps ``done..total``, and compare with single-process DMuon run ``total`` steps
    uninterrupted: per case, bitwise equal."""
    from tests.named_checkpoints import load_named

    oracle = {n: nn.Parameter(t) for n, t in _case_tensors(0).items()}
    _variant_steps(DMuon(_variant_groups(oracle), weight_decay=0.01, ns_dtype="float32"), oracle, range(total))
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))

    def shard(t: torch.Tensor) -> DTensor:
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    params = {n: nn.Parameter(shard(torch.zeros_like(t))) for n, t in _case_tensors(0).items()}
    optimizer = DMuon(_variant_groups(params), weight_decay=0.01, ns_dtype="float32")
    load_named(checkpoint_dir, params, optimizer)
    _variant_steps(optimizer, params, range(done, total), shard)
    return {n: torch.equal(params[n].full_tensor(), oracle[n].detach()) for n in oracle}


def cuda_graph_replay(steps: int = 3) -> bool:
    """``DMuon.step`` captured in a CUDA graph after warm-up and replayed: bitwise the
    eager steps of a twin optimizer on the same grads (static grads, as capture needs)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    full = _case_tensors(30)
    twins = []
    for _ in range(2):
        params = {name: nn.Parameter(distribute_tensor(t.cuda(), mesh, [Shard(0)], src_data_rank=None))
                  for name, t in full.items()}
        for name, param in params.items():
            param.grad = distribute_tensor(_case_tensors(31)[name].cuda(), mesh, [Shard(0)], src_data_rank=None)
        twins.append((params, DMuon(_groups(params), lr=0.02, weight_decay=0.1)))
    (captured, graphed), (eager, stepped) = twins
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: state, plan and layouts made before capture
            graphed.step()
            stepped.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for _ in range(steps):
        graph.replay()
        stepped.step()
    torch.cuda.synchronize()
    return all(torch.equal(captured[n].to_local(), eager[n].to_local()) for n in captured)
