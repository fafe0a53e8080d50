"""Sweep generated shapes, list orders, dtypes, layouts and switches over real gloo ranks
against one process (issue 60, item 1).

    python -m tests.shape_sweep --cases 500 --seed 0            # P = 1, 2 and 4
    python -m tests.shape_sweep --cases 100 --seed 3 --world 2
    python -m tests.shape_sweep --case P2-fsdp-fp32-int8-aint8-foreach-normuon.cwd-s17   # one case again
    python -m tests.shape_sweep --count                         # how many cases exist

The cases come from ``tests.shape_cases`` (every rank builds the same model from the id
the driver hands it), run many to a launch (``tests.shape_runner.run_cases``, every launch
under a timeout) and are judged here, per check:

- a: no exception on any rank (each phase's error, named);
- b: weights and optimizer state (Muon's momentum and the AdamW part's moments, in their
  forms) bitwise single-process DMuon's on the full tensors; int8 state held in bf16
  exactly where the layout cuts its rows off the blocks;
- c: nothing alive after the steps but parameters and state (bytes of new storages beyond
  the state, 0-dim scalars apart: :data:`SCALAR_ALLOWANCE`), and the momentum and AdamW
  moments the documented size;
- d: a DCP checkpoint loaded under another layout steps on as the uninterrupted oracle;
  where that layout changes which parameters keep int8 momentum (or int8 AdamW moments) in
  bf16, the load fails on every rank naming one of them (DCP cannot convert between the
  forms: docs/optimizer.md, "Resume on another layout with int8").

A launch that a case broke (a hang, a crash, ranks out of step) ends there; that case fails
check a and the cases after it run in a fresh launch. Prints a summary (cases, passed,
failed per check and per layout, time) and every failure with its case id.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from tests import fault_sweep
from tests.fault_sweep import Result, _last_error, _tail, launch
from tests.shape_cases import WORLDS, Case, count, params_of, parse, sample

CHECKS = {"a": "no exception / hang", "b": "equals one process", "c": "memory is params + state",
          "d": "DCP resume under another layout", "harness": "harness"}
CHECK_TIMEOUT_S = 60.0  # the most a case may take on a rank before it counts as a hang
LAUNCH_BASE_S, PER_CASE_S = 90.0, 8.0
# Check c's allowance: new 0-dim scalars alive after the steps (a capturable group's lr and
# weight_decay on the device, DMuon's device constants and step counters outside the state).
SCALAR_ALLOWANCE = 16
# The pending status sums (tests.shape_runner.ALLOWED_HOLDERS): dmuon.exchange.status_masks'
# BLOCKS (4) int32 entries per parameter, then 2 int32 counts.
STATUS_ALLOWANCE_PER_PARAM, STATUS_ALLOWANCE_BASE = 16, 8


def check_case(case: Case, ranks: list[dict]) -> list[tuple[str, str]]:
    """The failures of one case, from every rank's observations."""
    failures: list[tuple[str, str]] = []
    for rank, obs in enumerate(ranks):
        if "harness_error" in obs:
            failures.append(("harness", f"rank {rank}: {obs['harness_error']}"))
    if failures:
        return failures
    obs0 = ranks[0]
    errors = {phase: (rank, text) for rank, obs in reversed(list(enumerate(ranks)))
              for phase, text in obs.get("errors", {}).items()}
    for phase, (rank, text) in errors.items():
        failed = [r for r, o in enumerate(ranks) if phase in o.get("errors", {})]
        if phase == "load" and len(failed) == len(ranks) and _refused_across_the_fallback(text, obs0):
            continue
        check = "d" if phase in ("save", "load", "resumed_step") else "a"
        failures.append((check, f"{phase} raised on ranks {failed}: {_tail(text, 500)}"))
    differ = sorted({d for obs in ranks for d in obs.get("differ") or []})
    if differ:
        failures.append(("b", f"differ from one process: {_tail(', '.join(differ), 500)}"))
    for what, dtype, held_key, fallback_key in (("momentum", case.mdtype, "held_as", "bf16_fallback"),
                                                ("AdamW moments", case.adtype, "adamw_held_as", "adamw_bf16_fallback")):
        held = obs0.get(held_key) or {}
        want_bf16 = set(obs0.get(fallback_key, []))
        want = {"param": {"fp32": "float32", "bf16": "bfloat16"}[case.pdtype], "bf16": "bfloat16"}.get(dtype)
        wrong = {n: h for n, h in held.items() if h is not None and h != (
            want or ("bfloat16" if n in want_bf16 else "int8"))}
        if wrong:
            failures.append(("b", f"{dtype} {what} held as {wrong}; bf16 expected for {sorted(want_bf16)}"))
    memory = [obs.get("memory") for obs in ranks if obs.get("memory")]
    for rank, mem in enumerate(memory):
        per = mem["extra_bytes"] / max(1, mem["muon_local"])
        status_limit = STATUS_ALLOWANCE_BASE + STATUS_ALLOWANCE_PER_PARAM * len(params_of(case))
        if mem["extra_bytes"] or mem["scalars"] > SCALAR_ALLOWANCE or mem.get("allowed_bytes", 0) > status_limit:
            failures.append(("c", f"rank {rank}: {mem['extra_bytes']} B alive beyond params + state "
                                  f"({per:.3f} B per local Muon element), {mem['scalars']} new scalars: "
                                  f"{mem.get('allowed_bytes', 0)} B pending status: "
                                  + _tail("; ".join(mem["extra_top"] + mem["scalar_kinds"][:2]
                                                    + mem.get("allowed_kinds", [])[:1]), 500)))
            break
    sizes = obs0.get("state_bytes") or {}
    off = {n: v for n, v in sizes.items() if v[0] != v[1]}
    if off:
        failures.append(("c", "kept state bytes [got, documented]: " + _tail(str(off), 400)))
    resume = obs0.get("resume") or {}
    rdiffer = sorted({d for obs in ranks for d in (obs.get("resume") or {}).get("differ") or []})
    if rdiffer:
        failures.append(("d", f"after resuming under {resume.get('layout')}: {_tail(', '.join(rdiffer), 400)}"))
    if resume.get("form_changes") and any(c == "d" for c, _ in failures):
        failures.append(("d", f"(int8 state's form changes with the layout for {resume['form_changes']})"))
    return failures


def _refused_across_the_fallback(text: str, obs: dict) -> bool:
    """Whether a DCP load failed as docs/optimizer.md says it must ("Resume on another layout
    with int8"): the new layout changes which parameters keep int8 momentum (or int8 AdamW
    moments) in bf16, and DCP misses, naming it, a key of one of them (the other form's; a
    name's dots are underscores in the checkpoint: ``tests.named_checkpoints.as_module``)."""
    changed = (obs.get("resume") or {}).get("form_changes") or []
    return "Missing key" in text and any(f".{name.replace('.', '_')}.{key}" in text for name in changed
                                         for key in ("momentum_", "exp_avg"))


def run_launch(cases: list[Case], world: int, check_timeout_s: float) -> tuple[list[Result], list[Case]]:
    """Run cases in one launch; the results of those judged, and those left to run."""
    from tests.shape_runner import run_cases

    observed, error = launch(run_cases, world, [c.id for c in cases], check_timeout_s,
                             LAUNCH_BASE_S + PER_CASE_S * len(cases))
    results = []
    for index, case in enumerate(cases):
        ranks = observed.get(case.id, {})
        hung = {r: o["hang"] for r, o in ranks.items() if "hang" in o}
        if hung:
            results.append(Result(case, [("a", f"ranks {sorted(hung)} hung: {next(iter(hung.values()))}")]))
            return results, cases[index + 1:]
        if len(ranks) == world:
            slowest = max(o.get("seconds", 0.0) for o in ranks.values())
            results.append(Result(case, check_case(case, [ranks[r] for r in range(world)]), slowest))
            if error is not None and "LaunchStop" in error and case.id in error:
                results[-1].failures.append(("a", "the ranks went out of step (the launch ended here)"))
                return results, cases[index + 1:]
            continue
        if error is None:
            error = "the launch ended without this case's observations"
        missing = sorted(set(range(world)) - set(ranks))
        results.append(Result(case, [("a", f"ranks {missing} never finished the case (hang or crash): "
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
    lines = [f"shape sweep: {len(results)} cases, {len(results) - len(failed)} passed, {len(failed)} failed "
             f"in {seconds:.0f} s"]
    for world in sorted({r.case.world for r in results}):
        timed = [r.seconds for r in results if r.seconds is not None and r.case.world == world]
        if timed:
            lines.append(f"  a case at P={world}: {sum(timed) / len(timed):.2f} s on average, {max(timed):.2f} s "
                         f"at most (the rest is start-up and relaunches)")
    lines += [f"  check {c} ({CHECKS[c]}): {n} case(s)" for c, n in sorted(by_check.items())]
    lines.append("  failed by layout: " + ", ".join(f"{k} {by_layout[k]}/{layouts[k]}" for k in sorted(layouts)))
    for result in failed:
        lines.append(f"FAIL {result.case.id}")
        lines += [f"    [{check}] {text}" for check, text in result.failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m tests.shape_sweep", doc: str = __doc__,
         cases_of=None, run=None) -> int:
    """The sweep's command line; the memory sweep's too (``prog``, ``doc``, its ``cases_of``
    module with ``WORLDS``, ``count``, ``parse``, ``sample``, and ``run``, a module with
    ``CHECK_TIMEOUT_S``, ``sweep`` and ``summary``)."""
    import tests.shape_cases
    cases_of = cases_of or tests.shape_cases
    run = run or sys.modules[__name__]
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100, help="how many generated cases (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world", type=int, choices=cases_of.WORLDS, action="append",
                        help="P (repeat; default every P)")
    parser.add_argument("--case", action="append", default=[], help="run this case id (repeatable)")
    parser.add_argument("--per-launch", type=int, default=60, help="cases per launch of P ranks")
    parser.add_argument("--check-timeout", type=float, default=run.CHECK_TIMEOUT_S,
                        help="seconds a case may take on a rank before it counts as a hang")
    parser.add_argument("--max-failed", type=int, default=None, help="stop after this many failed cases")
    parser.add_argument("--count", action="store_true", help="print how many cases exist")
    args = parser.parse_args(argv)
    worlds = tuple(args.world or cases_of.WORLDS)
    if args.count:
        print(f"{cases_of.count(worlds)} cases (P in {list(worlds)})")
        return 0
    cases = [cases_of.parse(c) for c in args.case] if args.case else cases_of.sample(args.cases, args.seed, worlds)
    print(f"running {len(cases)} case(s) (seed {args.seed}, P in {sorted({c.world for c in cases})})", flush=True)
    start = time.perf_counter()
    results = run.sweep(cases, args.per_launch, args.check_timeout, max_failed=args.max_failed)
    print(run.summary(results, time.perf_counter() - start))
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
