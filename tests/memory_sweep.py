"""Sweep generated narrow, single-row, single-column, wide and 3-D Muon parameters, some never
given a grad, over real gloo ranks, and hold each case to its memory, measured from live
tensors (issue 67, item 2).

    python -m tests.memory_sweep --cases 150 --seed 1            # P = 1, 2 and 4
    python -m tests.memory_sweep --cases 60 --seed 3 --world 2
    python -m tests.memory_sweep --case P2-fsdp-fp32-int8-foreach-c1k-s17   # one case again
    python -m tests.memory_sweep --count                         # how many cases exist

The cases come from ``tests.memory_cases``. Every rank builds the case's model (the full
tensors drawn from the seed; a ``Shard(0)`` DTensor cut out of each, or the plain tensor),
steps DMuon :data:`STEPS` times on seeded grads (none for a frozen parameter), with
``zero_grad(set_to_none=True)`` after each step, and records what it holds
(:func:`run_cases`, in launches of many cases: ``tests.fault_sweep.launch``). Where the
case's ``momentum_dtype`` is not the parameter's, the same model with fp32 momentum
(``momentum_dtype=None``: the case's ``baseline``) is stepped first, on the same ranks,
for check c. The driver judges, per check:

- run: no exception or hang on any rank;
- a, at rest: after the steps and ``zero_grad``, nothing alive that did not exist before
  the first step but the optimizer state (every storage ``gc`` sees:
  ``benchmarks.live_tensors.live_storages``; ``tests.shape_runner.census``), beyond the
  shape sweep's allowances: a few 0-dim scalars (``tests.shape_sweep.SCALAR_ALLOWANCE``)
  and the step's pending status sums (``STATUS_ALLOWANCE_*``). A frozen parameter's zeros
  kept between steps fail it;
- b, the state: each parameter's momentum, the bytes of the storages its state holds on
  the rank, is ``dmuon.numerics.momentum_storage.bytes_per_element`` of its global shape
  times its local elements, in the form docs/optimizer.md documents (``param``: the
  parameter's dtype; bf16: 2; int8: 1 + 4 * ceil(w / 128) / w for rows of w elements,
  except rows narrower than 5 elements, kept in bf16: 2, decided here from the shape, not
  by dmuon's rule); a frozen parameter has no momentum at all, and the state holds nothing
  else;
- c, the peak: each step's peak (``benchmarks.live_tensors.PeakBytes``: every storage the
  step's ops made, until freed; the first step makes the state) on each rank at most the
  same step's peak with fp32 momentum on that rank plus one read chunk
  (:func:`read_allowance`); with fp32 momentum itself, or bf16 momentum of bf16 parameters,
  nothing is read and the allowance is 0.

**The read chunk's allowance.** A momentum kept in another dtype than its parameter's is
read into the parameter's dtype, updated and rounded back a chunk at a time: on the fast
path a pack chunk (``dmuon.plan.pack_layout.PACK_CHUNK_NUMEL`` elements), off it
``dmuon.state.kept_state.READ_CHUNK_NUMEL``, a larger tensor alone. So the elements
read at once are at most ``chunk = min(total, max(limit, largest))`` over the rank's
momenta held in another dtype, ``limit`` the larger of the two constants (the chunk the
dry run's bound counts, ``dmuon.tools.dry_run.memory_bound``): with the library's 2^24 that
is every such momentum of the rank at this sweep's sizes, not the largest alone; with a
case's ``c1k`` chunks (``tests.memory_cases.CHUNKS``, set on the ranks by :func:`chunked`)
1,024 elements or the largest tensor.

The step may hold, beside fp32 momentum's peak, :data:`READ_BYTES_PER_ELEMENT` = 12 bytes
per element of that chunk, three fp32 copies of it (the quantization works in fp32 whatever
the parameter's dtype), and :data:`READ_BYTES_PER_BLOCK` = 12 bytes per int8 block of it,
three fp32 numbers (at most ``ceil(chunk / w)`` blocks for rows of w elements). What
rounding a chunk back into int8 holds at once (``dmuon.numerics.momentum_storage``'s
``quantize_int8``, on the CPU): the working copy in the parameter's dtype (4 bytes an
element for fp32 parameters; 2 for bf16 ones, with its fp32 widening, 4), the
quantization's fp32 temporary (``|x|``, then the rounded sums: 4), the new int8 values (1),
and per block the new scale, the block's maximum and the divisor (12 bytes): 9 + 12 / w
bytes an element for fp32 parameters, 11 + 12 / w for bf16 ones (13.4 at w = 5), less where
fp32 momentum's own peak overlaps it: measured at most 11.4 above it (bf16 parameters, rows
of 5 elements, on the rank of 2 that does not own the matrix). Plus
:data:`READ_BYTES_PER_TENSOR` per tensor read (0-dim device constants). No more: a momentum
padded to its 128-element blocks (issue 67, defect 1) takes up to 128 / w times these
temporaries, and a rank that reads every momentum at once where its chunk is smaller, more.

**Measuring a peak.** Each step runs with Python's cyclic collector off (collected just
before), so a collection inside the step does not free its cycles at a moment that varies.
On P >= 2 ranks a peak may still count a buffer that a gloo worker thread lets go of a
moment after its ``wait()`` returned (``tests.shape_runner.census``): such a late free only
adds to a peak (measured: the same step's peak of the same model, alone 75,653 bytes every
time, 87,831 once among 15 runs under load). So where a step goes over check c's bound on any
rank, both models are stepped again, up to :data:`PEAK_TRIES` times in all, and each step's
least peak is judged (the summary counts the cases measured again).

A launch that a case broke (a hang, a crash, ranks out of step) ends there; that case fails
check ``run`` and the cases after it run in a fresh launch. Prints a summary (cases, passed,
failed per check and per layout, time) and every failure with its case id.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from datetime import timedelta
from typing import Any

from tests import fault_sweep
from tests.fault_sweep import Result, _last_error, _tail, launch
from tests.memory_cases import CHUNKS, Case, Param, narrow_widths, params_of, parse, row_length
from tests.shape_sweep import SCALAR_ALLOWANCE, STATUS_ALLOWANCE_BASE, STATUS_ALLOWANCE_PER_PARAM

CHECKS = {"run": "no exception / hang", "a": "at rest: params + state only", "b": "state at its documented bytes",
          "c": "peak within fp32 momentum's + one read chunk", "harness": "harness"}
STEPS = 3
CHECK_TIMEOUT_S = 120.0  # the most a case may take on a rank before it counts as a hang (P = 4 on 2 cores: 35 s)
LAUNCH_BASE_S, PER_CASE_S = 90.0, 20.0
FP32_BYTES = 4
# Module docstring, "The read chunk's allowance": per element of the chunk, per int8 block
# of it, per tensor read.
READ_BYTES_PER_ELEMENT = 3 * FP32_BYTES
READ_BYTES_PER_BLOCK = 3 * FP32_BYTES
READ_BYTES_PER_TENSOR = 64
PEAK_TRIES = 3  # module docstring: measures of a peak over check c's bound, the least of them judged
INT8_MIN_ROW = 5  # docs/optimizer.md: int8 rows narrower than this are kept in bf16


def documented_form(case: Case, param: Param) -> str:
    """The form docs/optimizer.md says the parameter's momentum is kept in: the parameter's
    dtype (``param``), ``bf16`` or ``int8`` (bf16 for int8 rows narrower than 5 elements)."""
    if case.mdtype == "int8" and row_length(param.shape) < INT8_MIN_ROW:
        return "bf16"
    return case.mdtype


def documented_bytes_per_element(case: Case, param: Param) -> float:
    from dmuon.numerics.momentum_storage import bytes_per_element
    import torch

    form = documented_form(case, param)
    return bytes_per_element(param.shape, {"param": None, "bf16": "bfloat16", "int8": "int8"}[form],
                             {"fp32": torch.float32, "bf16": torch.bfloat16}[case.pdtype])


def read_allowance(case: Case, local_numels: dict[str, int]) -> int:
    """Check c's allowance on a rank whose Muon parameters have ``local_numels`` (by name):
    one read chunk of the momenta held in another dtype than the parameter's (module
    docstring)."""
    from dmuon.numerics.momentum_storage import blocks_per_row
    from dmuon.plan.pack_layout import PACK_CHUNK_NUMEL
    from dmuon.state.kept_state import READ_CHUNK_NUMEL

    read = [p for p in params_of(case) if not p.frozen and documented_form(case, p) not in ("param", case.pdtype)]
    if not read:
        return 0
    numels = [local_numels[p.name] for p in read]
    limit = CHUNKS[case.chunk] or max(PACK_CHUNK_NUMEL, READ_CHUNK_NUMEL)
    chunk = min(sum(numels), max(limit, max(numels)))
    # The most int8 blocks an element of the chunk may bring (a block per row of up to 128).
    widths = [row_length(p.shape) for p in read if documented_form(case, p) == "int8"]
    blocks = max((math.ceil(chunk * blocks_per_row(w) / w) for w in widths), default=0)
    return READ_BYTES_PER_ELEMENT * chunk + READ_BYTES_PER_BLOCK * blocks + READ_BYTES_PER_TENSOR * len(read)


# ------------------------------------------------------------------------- on the ranks

# The chunk sizes a case's ``chunk`` sets (module attributes of that name in every dmuon module
# loaded: those that import one by name hold their own binding).
CHUNK_NAMES = ("PACK_CHUNK_NUMEL", "READ_CHUNK_NUMEL", "ROUNDING_CHUNK_NUMEL")


@contextlib.contextmanager
def chunked(case: Case):
    """Inside, dmuon reads, rounds and packs momentum ``CHUNKS[case.chunk]`` elements at a time
    (the library's own sizes for ``lib``); put back after."""
    import dmuon.plan.pack_layout  # noqa: F401 - every module that holds one is loaded
    import dmuon.step.fast_path  # noqa: F401
    import dmuon.tools.dry_run.memory_bound  # noqa: F401

    size = CHUNKS[case.chunk]
    held = [(module, name, getattr(module, name)) for key, module in list(sys.modules.items())
            if key.split(".")[0] == "dmuon" and module is not None for name in CHUNK_NAMES if hasattr(module, name)]
    try:
        if size is not None:
            for module, name, _ in held:
                setattr(module, name, size)
        yield
    finally:
        for module, name, value in held:
            setattr(module, name, value)



class Model:
    """The case's parameters (``Shard(0)`` DTensors or plain tensors) and their DMuon; the
    attributes ``tests.shape_runner.census`` reads (``specs``, ``params``, ``optimizer``)."""

    def __init__(self, case: Case) -> None:
        import torch
        from torch import nn
        from torch.distributed.tensor import Shard

        from benchmarks.layouts import as_dtensor
        from dmuon import DMuon
        from tests.shape_runner import meshes

        self.case, self.specs = case, params_of(case)
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.pdtype]
        self.params: dict[str, nn.Parameter] = {}
        for param in self.specs:
            full = self._seeded(param, 0)
            if case.layout == "plain":
                self.params[param.name] = nn.Parameter(full)
            else:
                self.params[param.name] = nn.Parameter(as_dtensor(full, meshes(case.world)["world"], (Shard(0),)))
        form = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "capturable": dict(capturable=True)}
        self.optimizer = DMuon([{"params": list(self.params.items()), "use_muon": True}], lr=0.03, momentum=0.9,
                               weight_decay=0.05, ns_dtype="float32",
                               momentum_dtype={"param": None, "bf16": "bfloat16", "int8": "int8"}[case.mdtype],
                               **form[case.form])

    def _seeded(self, param: Param, salt: int):
        import zlib

        import torch

        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.case.seed}-{param.name}".encode()) + 7919 * salt)
        return torch.randn(param.shape, generator=generator).to(self.dtype)

    def set_grads(self, step: int) -> None:
        from torch.distributed.tensor import DTensor

        from benchmarks.layouts import like

        for param in self.specs:
            if param.frozen:
                continue
            mine = self.params[param.name]
            mine.grad = like(mine, self._seeded(param, 1 + step)) if isinstance(mine, DTensor) \
                else self._seeded(param, 1 + step)

    def run(self, census: bool) -> dict[str, Any]:
        """Step :data:`STEPS` times: each step's peak, and with ``census`` what is alive after
        the steps beyond the state (``tests.shape_runner.census``) and the state's figures."""
        from benchmarks.live_tensors import PeakBytes, live_storages
        from tests.shape_runner import census as count_alive

        self.set_grads(0)
        gc.collect()
        before = live_storages() if census else None  # held meanwhile: no address is reused
        peaks = []
        for step in range(STEPS):
            if step:
                self.set_grads(step)
            peak = PeakBytes()
            gc.collect()
            gc.disable()  # a collection inside the step would free its cycles at a moment that varies
            try:
                with peak:
                    self.optimizer.step()
            finally:
                gc.enable()
            peaks.append(peak.bytes)
            self.optimizer.zero_grad(set_to_none=True)
        out: dict[str, Any] = {"peaks": peaks, "local": self.local_numels()}
        if census:
            out["memory"] = count_alive(self, before)
            out["state"] = self.state_figures()
        return out

    def local_numels(self) -> dict[str, int]:
        from torch.distributed.tensor import DTensor

        return {name: (p.to_local() if isinstance(p, DTensor) else p).numel() for name, p in self.params.items()}

    def state_figures(self) -> dict[str, Any]:
        """Per parameter: the state's keys with their dtypes, and the bytes of the storages
        they hold on this rank (``benchmarks.live_tensors.storage_key``: a view of a larger
        buffer counts the buffer)."""
        import torch

        from benchmarks.live_tensors import storage_key

        figures = {}
        for name, param in self.params.items():
            state = self.optimizer.state.get(param, {})
            storages = {key for value in state.values() if isinstance(value, torch.Tensor)
                        and (key := storage_key(value)) is not None}
            figures[name] = {"keys": {k: str(v.dtype).removeprefix("torch.") for k, v in state.items()
                                      if isinstance(v, torch.Tensor)},
                             "bytes": sum(size for _, size in storages)}
        return figures


def run_case(case: Case, meet) -> dict[str, Any]:
    """Everything this rank observed in one case (JSON-ready)."""
    from tests.shape_runner import Stop, _agree, _said, _where

    start = time.perf_counter()
    obs: dict[str, Any] = {"errors": {}}

    def phase(name: str, fn):  # noqa: ANN001, ANN202
        try:
            value, failed = fn(), False
        except Exception as error:  # noqa: BLE001 - recorded, named by phase
            obs["errors"][name] = _said(error)[:1500] + " @ " + _where(error)
            value, failed = None, True
        _agree(meet, failed)
        return value

    try:
        with chunked(case):
            if case.mdtype != "param":
                obs["baseline"] = phase("baseline", lambda: Model(case.baseline).run(census=False))
                gc.collect()
            obs["run"] = phase("steps", lambda: Model(case).run(census=True))
            obs["peak_tries"] = 1
            while case.mdtype != "param" and obs["peak_tries"] < PEAK_TRIES and _anyone(meet, _over(case, obs)):
                obs["peak_tries"] += 1  # module docstring: a peak another thread's late free raised
                for key, model in (("baseline", case.baseline), ("run", case)):
                    again = phase(key, lambda: Model(model).run(census=False))
                    obs[key]["peaks"] = [min(a, b) for a, b in zip(obs[key]["peaks"], again["peaks"])]
                    gc.collect()
    except Stop as stop:
        obs["stopped_by"] = stop.args[0]
    obs["seconds"] = round(time.perf_counter() - start, 3)
    return obs


def _over(case: Case, obs: dict[str, Any]) -> bool:
    """Whether a step's peak on this rank passed check c's bound."""
    allowance = read_allowance(case, obs["run"]["local"])
    return any(peak > base + allowance for peak, base in zip(obs["run"]["peaks"], obs["baseline"]["peaks"]))


def _anyone(meet, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (every rank takes part)."""
    import torch.distributed as dist

    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag, group=meet)
    return any(flags)


def run_cases(case_ids: list[str], out_dir: str, check_timeout_s: float) -> dict[str, Any]:
    """Run the cases on this rank; one JSON line each in ``out_dir/rank<r>.jsonl``."""
    import torch.distributed as dist

    from tests.fault_runner import LaunchStop, _watchdog
    from tests.shape_runner import _where

    rank = dist.get_rank()
    logging.getLogger("dmuon").setLevel(logging.WARNING)  # the int8 fallback's line, once per parameter
    meet = dist.new_group(backend="gloo", timeout=timedelta(seconds=check_timeout_s))
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    for case_id in case_ids:
        case = parse(case_id)
        timer = _watchdog(check_timeout_s, path, case_id, rank)
        try:
            obs = run_case(case, meet)
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


# ------------------------------------------------------------------------- the checks


def check_case(case: Case, ranks: list[dict]) -> list[tuple[str, str]]:
    """The failures of one case, from every rank's observations."""
    failures: list[tuple[str, str]] = []
    for rank, obs in enumerate(ranks):
        if "harness_error" in obs:
            failures.append(("harness", f"rank {rank}: {obs['harness_error']}"))
    if failures:
        return failures
    errors = {phase: (rank, text) for rank, obs in reversed(list(enumerate(ranks)))
              for phase, text in obs.get("errors", {}).items()}
    for phase, (rank, text) in errors.items():
        failed = [r for r, o in enumerate(ranks) if phase in o.get("errors", {})]
        failures.append(("run", f"{phase} raised on ranks {failed}: {_tail(text, 500)}"))
    if errors:
        return failures
    params = params_of(case)
    for rank, obs in enumerate(ranks):
        mem = obs["run"]["memory"]
        status_limit = STATUS_ALLOWANCE_BASE + STATUS_ALLOWANCE_PER_PARAM * len(params)
        if mem["extra_bytes"] or mem["scalars"] > SCALAR_ALLOWANCE or mem.get("allowed_bytes", 0) > status_limit:
            failures.append(("a", f"rank {rank}: {mem['extra_bytes']} B alive beyond params + state "
                                  f"({mem['extra_bytes'] / max(1, mem['muon_local']):.3f} B per local Muon element), "
                                  f"{mem['scalars']} new scalars, {mem.get('allowed_bytes', 0)} B pending status: "
                                  + _tail("; ".join(mem["extra_top"] + mem["scalar_kinds"][:2]
                                                    + mem.get("allowed_kinds", [])[:1]), 500)))
            break
    failures += _state_failures(case, params, ranks)
    failures += _peak_failures(case, ranks)
    return failures


def _state_failures(case: Case, params: list[Param], ranks: list[dict]) -> list[tuple[str, str]]:
    """Check b on every rank."""
    want_keys = {"param": {"momentum_buffer": case.pdtype}, "bf16": {"momentum_buffer": "bf16"},
                 "int8": {"momentum_int8": "int8", "momentum_scales": "fp32"}}
    names = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
    off = []
    for rank, obs in enumerate(ranks):
        state, local = obs["run"]["state"], obs["run"]["local"]
        for param in params:
            got = state[param.name]
            keys = {k: names.get(v, v) for k, v in got["keys"].items()}
            if param.frozen:
                want, per = {}, 0.0
            else:
                want, per = want_keys[documented_form(case, param)], documented_bytes_per_element(case, param)
            expected = per * local[param.name]
            if keys != want or abs(got["bytes"] - expected) > 1e-6 * max(1.0, expected):
                held = (f"{got['bytes'] / local[param.name]:.3f} B an element" if local[param.name]
                        else f"{got['bytes']} B on an empty shard")
                off.append(f"rank {rank} {param.name}{list(param.shape)}{' (frozen)' if param.frozen else ''}: "
                           f"{keys or 'no state'} at {held}, documented {want or 'no state'} at {per:.3f} B an "
                           "element")
        if len(off) >= 4:
            break
    return [("b", _tail("; ".join(off), 700))] if off else []


def peak_use(case: Case, ranks: list[dict]) -> float | None:
    """How much of check c's allowance the case used at most (a rank's step), as a fraction:
    (peak - fp32 momentum's peak) / allowance; None where there is no allowance to use."""
    if case.mdtype == "param" or any("errors" not in o or o["errors"] for o in ranks):
        return None
    uses = [(peak - base) / allowance for obs in ranks if (allowance := read_allowance(case, obs["run"]["local"]))
            for peak, base in zip(obs["run"]["peaks"], obs["baseline"]["peaks"])]
    return max(uses, default=None)


def _peak_failures(case: Case, ranks: list[dict]) -> list[tuple[str, str]]:
    """Check c on every rank, step by step."""
    if case.mdtype == "param":
        return []
    worst = None
    for rank, obs in enumerate(ranks):
        allowance = read_allowance(case, obs["run"]["local"])
        elements = max(1, sum(obs["run"]["local"].values()))
        for step, (peak, base) in enumerate(zip(obs["run"]["peaks"], obs["baseline"]["peaks"])):
            over = peak - base - allowance
            if over > 0 and (worst is None or over > worst[0]):
                worst = (over, f"rank {rank}, step {step + 1}: peak {peak} B ({peak / elements:.2f} B per local "
                               f"Muon element), fp32 momentum's {base} B ({base / elements:.2f}), one read chunk "
                               f"{allowance} B: {over} B over")
    return [("c", worst[1])] if worst else []


# ------------------------------------------------------------------------- the driver


def run_launch(cases: list[Case], world: int, check_timeout_s: float) -> tuple[list[Result], list[Case]]:
    """Run cases in one launch; the results of those judged, and those left to run."""
    observed, error = launch(run_cases, world, [c.id for c in cases], check_timeout_s,
                             LAUNCH_BASE_S + PER_CASE_S * len(cases))
    results = []
    for index, case in enumerate(cases):
        ranks = observed.get(case.id, {})
        hung = {r: o["hang"] for r, o in ranks.items() if "hang" in o}
        if hung:
            results.append(Result(case, [("run", f"ranks {sorted(hung)} hung: {next(iter(hung.values()))}")]))
            return results, cases[index + 1:]
        if len(ranks) == world:
            slowest = max(o.get("seconds", 0.0) for o in ranks.values())
            results.append(Result(case, check_case(case, [ranks[r] for r in range(world)]), slowest))
            results[-1].peak_use = peak_use(case, [ranks[r] for r in range(world)])  # for the summary
            results[-1].peak_tries = max(o.get("peak_tries", 1) for o in ranks.values())
            if error is not None and "LaunchStop" in error and case.id in error:
                results[-1].failures.append(("run", "the ranks went out of step (the launch ended here)"))
                return results, cases[index + 1:]
            continue
        if error is None:
            error = "the launch ended without this case's observations"
        missing = sorted(set(range(world)) - set(ranks))
        results.append(Result(case, [("run", f"ranks {missing} never finished the case (hang or crash): "
                                              f"{_last_error(error)}")]))
        return results, cases[index + 1:]
    return results, []


def sweep(cases: list[Case], per_launch: int, check_timeout_s: float = CHECK_TIMEOUT_S, log=print,
          max_failed: int | None = None) -> list[Result]:
    """Every case, ``per_launch`` to a launch per world size (``tests.fault_sweep.sweep``'s
    loop, with this sweep's launches); with ``max_failed``, stop once that many cases failed."""
    return fault_sweep.sweep(cases, per_launch, check_timeout_s, log, max_failed, run_launch=run_launch)


def summary(results: list[Result], seconds: float) -> str:
    failed = [r for r in results if r.failures]
    by_check = Counter(check for r in failed for check in {c for c, _ in r.failures})
    layouts = Counter(f"P{r.case.world}-{r.case.layout}" for r in results)
    by_layout = Counter(f"P{r.case.world}-{r.case.layout}" for r in failed)
    widths = set().union(*(narrow_widths(r.case) for r in results))
    lines = [f"memory sweep: {len(results)} cases, {len(results) - len(failed)} passed, {len(failed)} failed "
             f"in {seconds:.0f} s ({len(widths)} of the 130 row widths 1..130)"]
    for world in sorted({r.case.world for r in results}):
        timed = [r.seconds for r in results if r.seconds is not None and r.case.world == world]
        if timed:
            lines.append(f"  a case at P={world}: {sum(timed) / len(timed):.2f} s on average, {max(timed):.2f} s "
                         f"at most (the rest is start-up and relaunches)")
    used = [(u, r.case.id) for r in results if (u := getattr(r, "peak_use", None)) is not None]
    if used:
        most = max(used)
        again = sum(getattr(r, "peak_tries", 1) > 1 for r in results)
        lines.append(f"  check c: a case's peak used {100 * sorted(u for u, _ in used)[len(used) // 2]:.0f}% of its "
                     f"read chunk's allowance at the median, {100 * most[0]:.0f}% at most ({most[1]}); "
                     f"{again} case(s) measured again")
    lines += [f"  check {c} ({CHECKS[c]}): {n} case(s)" for c, n in sorted(by_check.items())]
    lines.append("  failed by layout: " + ", ".join(f"{k} {by_layout[k]}/{layouts[k]}" for k in sorted(layouts)))
    for result in failed:
        lines.append(f"FAIL {result.case.id}")
        lines += [f"    [{check}] {text}" for check, text in result.failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The shape sweep's command line over this sweep's cases and checks."""
    from tests import memory_cases, shape_sweep

    return shape_sweep.main(argv, "python -m tests.memory_sweep", __doc__, memory_cases, sys.modules[__name__])


if __name__ == "__main__":
    sys.exit(main())
