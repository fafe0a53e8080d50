"""The fault sweep on one rank: run cases, record what happened, compare with one process.

``run_cases(case_ids, out_dir, check_timeout_s)`` runs on every rank of a launch
(``tests.multiprocess.run_on_ranks``). Per case, each rank writes one JSON line of
observations to ``out_dir/rank<r>.jsonl`` *before* it meets the other ranks, so what a
hang or a crash leaves behind still says which case it was (``tests.fault_sweep`` reads
the files, judges each case with ``tests.fault_checks`` and relaunches after a case that
broke the launch).

Per step of a case a rank records:

- its outcome: None or ``"<Type>: <message>"``;
- its collectives, two ways: per op dispatched to the backend, its tensors' shapes and
  dtypes and the ranks of the real gloo group it runs on (a dispatch mode that sees
  ``c10d``/``_c10d_functional`` ops: DTensor's functional collectives included; the only
  place the group is named), and at the faulty step and the one after, the gloo backend's
  own calls (``torch.profiler`` events named ``gloo:*``, with dtypes and shapes), kept for
  reading a failure (not compared: they run on gloo's threads, see ``tests.fault_checks``);
- digests of the bits of every parameter and state tensor of its DMuon (``-0.0`` and NaN
  payloads included: raw bytes), before and after the faulty step and the one after.

After the case it compares its local parameters and state keys with a one-process DMuon
(plain full tensors, the same options and seeds) and records which differ. The ranks then
exchange a short signature on a group of their own (with its own timeout): a rank stuck
in a collective of the case, or ranks whose collectives differed, end the launch there, so
the next case starts on fresh process groups instead of inheriting a desync.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fault_cases import Case, expected, parse
from tests.fault_model import Model, build, placement_of, report_logits, set_grads

AFTER = 2  # clean steps after the one after the fault (contract item 5)
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier")


class LaunchStop(RuntimeError):
    """The ranks left a case out of step (a hang, or different collectives): end the launch."""


# ------------------------------------------------------------------ recording collectives


def _group_ranks(arg: Any) -> tuple[int, ...] | None:
    """The ranks of a c10d op's group argument (a ProcessGroup script object or a group name)."""
    try:
        if isinstance(arg, str):
            group = dist.distributed_c10d._resolve_process_group(arg)
        else:
            group = dist.ProcessGroup.unbox(arg)
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - not a group
        return None


def _tensors(args: Any) -> list[torch.Tensor]:
    found = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found += [a for a in arg if isinstance(a, torch.Tensor)]
    return found


class _GroupRecorder(TorchDispatchMode):
    """Every collective op dispatched, with its tensors' shapes/dtypes and its group's ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[list] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.name()
        if func.namespace in COLLECTIVE_NAMESPACES and not any(n in name for n in NOT_COLLECTIVES):
            ranks = next((r for a in args if (r := _group_ranks(a)) is not None), None)
            self.ops.append([name.split("::")[-1], list(ranks) if ranks else None,
                             [[list(t.shape), str(t.dtype)] for t in _tensors(args)]])
        return func(*args, **(kwargs or {}))


@contextmanager
def recording(into: dict[str, list], backend: bool = True):
    """Record the collectives run inside into ``into["groups"]`` (the dispatch mode: cheap)
    and, with ``backend``, ``into["gloo"]`` (the profiler: about 0.1 s a step here)."""
    groups = _GroupRecorder()
    if not backend:
        with groups:
            yield
        into["groups"] = groups.ops
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        with groups:
            yield
    events = [e for e in prof.profiler.kineto_results.events() if e.name().startswith("gloo:")]
    events.sort(key=lambda e: e.start_ns())
    into["gloo"] = [[e.name(), [str(d) for d in e.dtypes()], [list(s) for s in e.shapes()]] for e in events]
    into["groups"] = groups.ops


# ------------------------------------------------------------------ state snapshots


def _digest(tensor: torch.Tensor) -> str:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    local = local.detach().contiguous()
    raw = local.reshape(-1).view(torch.uint8) if local.numel() else torch.empty(0, dtype=torch.uint8)
    return f"{local.dtype}{tuple(local.shape)}:" + hashlib.sha1(raw.numpy().tobytes()).hexdigest()[:16]


def snapshot(model: Model) -> dict[str, str]:
    """Digests of this rank's bits of every parameter and every state value of its DMuon
    (keys ``name`` and ``name/key``; AdamW's step counts and QK-clip's rows included)."""
    snap = {}
    for name, param in model.params.items():
        snap[name] = _digest(param)
        for key, value in model.optimizer.state.get(param, {}).items():
            snap[f"{name}/{key}"] = _digest(value) if isinstance(value, torch.Tensor) else repr(value)
    return snap


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# ------------------------------------------------------------------ one case


def _error(fn) -> str | None:  # noqa: ANN001
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the outcome is the text
        return f"{type(error).__name__}: {error}"
    return None


def steps_of(case: Case) -> int:
    return case.k + 2 + AFTER


def run_steps(case: Case, model: Model, rank: int, skip: frozenset[int] = frozenset(), record: bool = False
              ) -> dict[str, Any]:
    """Step ``model`` through the case (skipping ``skip``): outcomes, collectives, snapshots."""
    out: dict[str, Any] = {"outcomes": [], "seq": [], "snaps": {}}
    for step in range(steps_of(case)):
        if step in skip:
            out["outcomes"].append("skipped")
            out["seq"].append(None)
            continue
        set_grads(case, model, step, rank)
        report_logits(case, model, step)
        if step in (case.k, case.k + 1):
            out["snaps"][f"before{step}"] = snapshot(model)
        seq: dict[str, list] = {}
        if record:
            with recording(seq, backend=step in (case.k, case.k + 1)):
                outcome = _error(model.optimizer.step)
                # Telemetry's sum runs on gloo's threads after step() returns: wait for it
                # before the profiler stops (an event landing after the stop crashed a rank).
                model.optimizer.telemetry()
        else:
            outcome = _error(model.optimizer.step)
        out["outcomes"].append(outcome)
        out["seq"].append(seq or None)
        if step in (case.k, case.k + 1):
            if case.setting == "skip_nonfinite" and not model.full:
                # Read as a checkpoint would: state_dict() first takes back the host step
                # counters of a skipped step (else the next step() does).
                model.optimizer.state_dict()
            out["snaps"][f"after{step}"] = snapshot(model)
    out["skipped_steps"] = model.optimizer.skipped_steps  # read by the steps after k (skip_nonfinite)
    return out


def _bits_equal(mine: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal, NaNs compared as NaNs (same places; payload bits not compared: one
    process and P ranks may produce NaNs of either sign)."""
    if mine.shape != want.shape or mine.dtype != want.dtype:
        return False
    if not mine.is_floating_point():  # int8 values, counters: no NaN, every bit compared
        return torch.equal(mine, want)
    nan = mine.isnan()
    if not torch.equal(nan, want.isnan()):
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[mine.element_size()]
    return torch.equal(mine.masked_fill(nan, 0).view(ints), want.masked_fill(nan, 0).view(ints))


def _is_muon(model: Model, param: torch.Tensor) -> bool:
    return any(param is q for g in model.optimizer.param_groups if g["use_muon"] for q in g["params"])


def _local_of_reference(mine: Any, want: Any) -> Any:
    """The reference's value (a full tensor) as this rank holds it: cut as ``mine`` is cut
    (a DTensor: DTensor's own block of it, as the parameters are cut)."""
    if isinstance(mine, DTensor) and isinstance(want, torch.Tensor):
        return distribute_tensor(want.detach(), mine.device_mesh, list(mine.placements), src_data_rank=None).to_local()
    return want.detach() if isinstance(want, torch.Tensor) else want


def compare_with(case: Case, model: Model, reference: Model) -> list[str]:
    """Parameters, state key sets and state values (Muon's momentum, NorMuon's moments, the
    AdamW part's moments in their form: int8 values and scales included, step counts) of this
    rank that differ from the reference's."""
    differ = []
    for name, param in model.params.items():
        want = reference.params[name].detach()
        where = placement_of(case, name)
        if where is not None:
            want = distribute_tensor(want, where[0], list(where[1]), src_data_rank=None).to_local()
        mine = param.detach().to_local() if isinstance(param, DTensor) else param.detach()
        # torch's fused CPU AdamW rounds its vector body and its tail differently (exp_avg_sq):
        # a shard's bits follow its length, so one process on the full tensor is no bitwise
        # reference for it, nor for its moments (docs/optimizer.md, "foreach and fused").
        fused_shard = case.setting == "fused" and isinstance(param, DTensor) and not _is_muon(model, param)
        if not fused_shard and not _bits_equal(mine, want):
            differ.append(name)
        held, theirs = model.optimizer.state.get(param, {}), reference.optimizer.state.get(reference.params[name], {})
        keys = sorted(held)
        if keys != sorted(theirs):
            differ.append(f"{name}: state keys {keys}")
            continue
        for key in keys:
            value, wanted = held[key], _local_of_reference(held[key], theirs[key])
            if not isinstance(value, torch.Tensor) or not isinstance(wanted, torch.Tensor):
                same = value == wanted
            elif fused_shard and key != "step":
                same = True
            else:
                local = value.detach().to_local() if isinstance(value, DTensor) else value.detach()
                same = _bits_equal(local.reshape(-1), wanted.reshape(-1)) and local.shape == wanted.shape
            if not same:
                differ.append(f"{name}/{key}")
    return differ


def references(case: Case, rank: int) -> dict[str, Any]:
    """One-process runs this case may be judged against: ``all`` (every step, this rank's
    view of the grads; QK-clip's errors caught as they come), ``skip`` (the faulty step
    and the one after left out) and ``skip_k`` (the faulty step left out)."""
    outcome = expected(case, rank).outcome
    wanted = {"clean": ["all"], "valid": ["all"], "qk": ["all"], "local_error": ["skip"], "disagree": ["skip"],
              "skipped": ["skip_k"]}
    variants = wanted.get(outcome, ["all", "skip"])
    if case.layout == "pp":
        # The stages judge by different variants, but a plain-tensor DMuon's QK-clip MAX and
        # telemetry sum run over the whole world: every rank steps every reference, in one order.
        variants = ["all", "skip"] + (["skip_k"] if case.setting == "skip_nonfinite" else [])
    out = {}
    for variant in variants:
        skip = {"skip": frozenset({case.k, case.k + 1}), "skip_k": frozenset({case.k})}.get(variant, frozenset())
        out[variant] = (build(case, full=True), skip)
    return out


def run_case(case: Case, rank: int, twins: dict) -> dict[str, Any]:
    """Everything this rank observed in one case (JSON-ready)."""
    start = time.perf_counter()
    model = build(case)
    obs = run_steps(case, model, rank, record=True)
    snaps = obs.pop("snaps")
    k = case.k
    obs["changed"] = {
        "by_k": changed(snaps.get(f"before{k}", {}), snaps.get(f"after{k}", {})),
        "by_k1": changed(snaps.get(f"before{k + 1}", {}), snaps.get(f"after{k + 1}", {})),
        "over_k_k1": changed(snaps.get(f"before{k}", {}), snaps.get(f"after{k + 1}", {})),
    }
    obs["reference"] = {}
    for variant, (reference, skip) in references(case, rank).items():
        ran = run_steps(case, reference, rank, skip=skip)
        obs["reference"][variant] = {"differ": compare_with(case, model, reference), "outcomes": ran["outcomes"]}
    obs["twin"] = clean_twin(case, rank, twins)
    obs["seconds"] = round(time.perf_counter() - start, 3)
    return obs


def clean_twin(case: Case, rank: int, twins: dict) -> list:
    """The collectives of the same model's first steps with no fault (per configuration,
    cached for the launch): what a clean step ``k`` runs on this rank."""
    key = (case.world, case.layout, case.setting, case.qk, case.adtype)
    if key not in twins:  # a fault on no rank
        clean = Case(case.world, case.layout, case.setting, "nan", "qk_head" if case.qk else "muon", (), 0, case.adtype)
        twins[key] = run_steps(clean, build(clean), rank, record=True)["seq"][:2]
    return twins[key]


# ------------------------------------------------------------------ the launch


def per_group(seq: dict[str, list] | None) -> dict[str, list]:
    """One step's collectives by group: what every rank of that group must run alike (op,
    dtypes, and sizes except an all-to-all's, whose splits differ from rank to rank)."""
    by_group: dict[str, list] = {}
    for op, ranks, tensors in (seq or {}).get("groups", []):
        sizes = None if "alltoall" in op or "all_to_all" in op else [shape for shape, _ in tensors]
        by_group.setdefault(str(ranks), []).append([op, [dtype for _, dtype in tensors], sizes])
    return by_group


def _signature(obs: dict[str, Any]) -> list:
    """What must agree across ranks for the launch to go on: per step, each group's ops."""
    return [per_group(seq) for seq in obs.get("seq") or []]


def _out_of_step(signatures: list[list]) -> bool:
    """Whether two ranks ran different ops on a group they share in some step."""
    steps = max(len(s) for s in signatures)
    for step in range(steps):
        seen: dict[str, list] = {}
        for sig in signatures:
            for group, ops in (sig[step] if step < len(sig) else {}).items():
                if seen.setdefault(group, ops) != ops:
                    return True
    return False


def _watchdog(seconds: float, path: str, case_id: str, rank: int) -> threading.Timer:
    """End this process if a case makes no progress for ``seconds``: every rank may be stuck
    in a collective of the case (the default group's own timeout is 30 minutes), so no
    rank would reach the others. It leaves a line saying so; the launcher sees a rank die."""
    def fire() -> None:
        with open(path, "a") as out:
            out.write(json.dumps({"case": case_id, "rank": rank, "obs": {"hang": f"no progress in {seconds:.0f} s"}})
                      + "\n")
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def run_cases(case_ids: list[str], out_dir: str, check_timeout_s: float) -> dict[str, Any]:
    """Run the cases on this rank; one JSON line each in ``out_dir/rank<r>.jsonl``."""
    rank = dist.get_rank()
    meet = dist.new_group(backend="gloo", timeout=timedelta(seconds=check_timeout_s))
    twins: dict = {}
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    for case_id in case_ids:
        case = parse(case_id)
        timer = _watchdog(check_timeout_s, path, case_id, rank)
        try:
            obs = run_case(case, rank, twins)
        except Exception as error:  # noqa: BLE001 - a harness error is reported with its case
            obs = {"harness_error": f"{type(error).__name__}: {error}"}
        with open(path, "a") as out:
            out.write(json.dumps({"case": case_id, "rank": rank, "obs": obs}) + "\n")
        signatures: list = [None] * dist.get_world_size()
        dist.all_gather_object(signatures, _signature(obs), group=meet)
        timer.cancel()
        if _out_of_step(signatures):
            raise LaunchStop(f"{case_id}: ranks ran different collectives; ending the launch")
    return {"done": len(case_ids)}
