"""Sweep generated rank-asymmetric faults over real gloo ranks (issue 40, item 8).

    python -m tests.fault_sweep --cases 500 --seed 0            # P = 2 and 4
    python -m tests.fault_sweep --cases 100 --seed 3 --world 4
    python -m tests.fault_sweep --case P4-hsdp-telemetry-nan-muon-r1.3-k1   # one case again
    python -m tests.fault_sweep --count                         # how many cases exist

The cases come from ``tests.fault_cases`` (every rank builds the same list from the ids
the driver hands it), run many to a launch (``tests.fault_runner.run_cases``, every launch
under a timeout) and are judged by ``tests.fault_checks``. A launch that a case broke (a
hang, a crash, ranks out of step) ends there; that case fails contract item 1 (or 2) and
the cases after it run in a fresh launch. Prints a summary (cases, passed, failed per
contract item and per fault kind, time) and every failure with its case id.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.fault_cases import WORLDS, Case, all_cases, parse, sample
from tests.fault_checks import Failure, check_case

ITEMS = {0: "harness", 1: "no hang / crash", 2: "same collectives", 3: "outcome", 4: "raising step changes nothing",
         5: "usable, equals one process", 6: "plain tensors"}
CHECK_TIMEOUT_S = 45.0  # the most a case may take on a rank before it counts as a hang
LAUNCH_BASE_S, PER_CASE_S = 120.0, 10.0


@dataclass
class Result:
    case: Case
    failures: list[Failure] = field(default_factory=list)
    seconds: float | None = None  # the case's time on its slowest rank (None: it never finished)


def _read(out_dir: str, world: int) -> dict[str, dict[int, dict]]:
    """Case id -> rank -> observations, from the launch's per-rank files."""
    found: dict[str, dict[int, dict]] = {}
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                found.setdefault(record["case"], {})[record["rank"]] = record["obs"]
    return found


def launch(run_cases: Callable[..., Any], world: int, case_ids: list[str], check_timeout_s: float, timeout: float
           ) -> tuple[dict[str, dict[int, dict]], str | None]:
    """``run_cases(case_ids, out_dir, check_timeout_s)`` on ``world`` fresh ranks (a case may
    desync the group), under ``timeout``: what each rank reported per case (:func:`_read`), and
    the launch's error, or None (a broken launch is a finding, judged by the caller)."""
    from tests.multiprocess import run_on_ranks

    out_dir = tempfile.mkdtemp(prefix="sweep_")
    error = None
    try:
        run_on_ranks(run_cases, world, case_ids, out_dir, check_timeout_s, timeout=timeout, fresh=True)
    except Exception as launch_error:  # noqa: BLE001 - judged by the caller
        error = f"{type(launch_error).__name__}: {launch_error}"
    observed = _read(out_dir, world)
    shutil.rmtree(out_dir, ignore_errors=True)
    return observed, error


def run_launch(cases: list[Case], world: int, check_timeout_s: float) -> tuple[list[Result], list[Case]]:
    """Run cases in one launch; the results of those judged, and those left to run."""
    from tests.fault_runner import run_cases

    observed, error = launch(run_cases, world, [c.id for c in cases], check_timeout_s,
                             LAUNCH_BASE_S + PER_CASE_S * len(cases))
    results = []
    for index, case in enumerate(cases):
        ranks = observed.get(case.id, {})
        hung = {r: o["hang"] for r, o in ranks.items() if "hang" in o}
        if hung:
            results.append(Result(case, [(1, f"ranks {sorted(hung)} hung: {next(iter(hung.values()))}")]))
            return results, cases[index + 1 :]
        if len(ranks) == world:
            slowest = max(o.get("seconds", 0.0) for o in ranks.values())
            results.append(Result(case, check_case(case, [ranks[r] for r in range(world)]), slowest))
            stopped = error is not None and "LaunchStop" in error and case.id in error
            if stopped and not any(item == 2 for item, _ in results[-1].failures):
                results[-1].failures.append((2, "the ranks went out of step (the launch ended here)"))
            continue
        if error is None:
            error = "the launch ended without this case's observations"
        missing = sorted(set(range(world)) - set(ranks))
        seen = "; ".join(f"rank {r} saw {_tail(str(o.get('outcomes', o)), 300)}" for r, o in sorted(ranks.items()))
        results.append(Result(case, [(1, f"ranks {missing} never finished the case (hang or crash): "
                                         f"{_last_error(error)}" + (f"; {seen}" if seen else ""))]))
        return results, cases[index + 1 :]
    return results, []


def _last_error(text: str) -> str:
    """The launcher's message cut to what says why: its first line and the last exception line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    causes = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
    return _tail(lines[0] + (" ... " + causes[-1] if causes and causes[-1] != lines[0] else ""), 400)


def _tail(text: str, limit: int = 600) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "..." + text[-limit:]


def sweep(cases: list, per_launch: int, check_timeout_s: float, log=print, max_failed: int | None = None,
          run_launch: Callable[..., tuple[list[Result], list]] = run_launch) -> list[Result]:
    """Every case, ``per_launch`` to a launch per world size, relaunching after a broken one;
    with ``max_failed``, stop once that many cases failed (a CI run on broken code ends soon).
    ``run_launch``: how one launch runs and judges its cases (the shape sweep passes its own)."""
    results: list[Result] = []
    for world in sorted({c.world for c in cases}):
        pending = [c for c in cases if c.world == world]
        while pending and (max_failed is None or sum(bool(r.failures) for r in results) < max_failed):
            batch, rest = pending[:per_launch], pending[per_launch:]
            done, left = run_launch(batch, world, check_timeout_s)
            results += done
            failed = sum(bool(r.failures) for r in done)
            log(f"  P={world}: {len(done)} cases ({failed} failed), {len(left) + len(rest)} to go", flush=True)
            pending = left + rest
    return results


def summary(results: list[Result], seconds: float) -> str:
    failed = [r for r in results if r.failures]
    by_item = Counter(item for r in failed for item in {i for i, _ in r.failures})
    by_kind = Counter(r.case.kind for r in failed)
    kinds = Counter(r.case.kind for r in results)
    timed = [r.seconds for r in results if r.seconds is not None]
    lines = [f"fault sweep: {len(results)} cases, {len(results) - len(failed)} passed, {len(failed)} failed "
             f"in {seconds:.0f} s (a case: {sum(timed) / max(1, len(timed)):.2f} s on average, "
             f"{max(timed, default=0):.2f} s at most; the rest is start-up and relaunches)"]
    lines += [f"  item {item} ({ITEMS[item]}): {n} case(s)" for item, n in sorted(by_item.items())]
    lines.append("  failed by fault kind: " + ", ".join(f"{k} {by_kind[k]}/{kinds[k]}" for k in sorted(kinds)))
    for result in failed:
        lines.append(f"FAIL {result.case.id}")
        lines += [f"    [{item}] {text}" for item, text in result.failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fault_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100, help="how many generated cases (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world", type=int, choices=WORLDS, action="append", help="P (repeat; default 2 and 4)")
    parser.add_argument("--case", action="append", default=[], help="run this case id (repeatable)")
    parser.add_argument("--per-launch", type=int, default=60, help="cases per launch of P ranks")
    parser.add_argument("--check-timeout", type=float, default=CHECK_TIMEOUT_S,
                        help="seconds a case may take on a rank before it counts as a hang")
    parser.add_argument("--max-failed", type=int, default=None, help="stop after this many failed cases")
    parser.add_argument("--count", action="store_true", help="print how many cases exist and why some are skipped")
    parser.add_argument("--detail", action="store_true",
                        help="run under TORCH_DISTRIBUTED_DEBUG=DETAIL (gloo checks every collective's fingerprint)")
    args = parser.parse_args(argv)
    worlds = tuple(args.world or WORLDS)
    if args.count:
        cases, skipped = all_cases(worlds)
        reasons = Counter(reason for _, reason in skipped)
        print(f"{len(cases)} cases; {len(skipped)} combinations skipped:")
        for reason, n in reasons.most_common():
            print(f"  {n:6d}  {reason}")
        return 0
    if args.detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    cases = [parse(c) for c in args.case] if args.case else sample(args.cases, args.seed, worlds)
    print(f"running {len(cases)} case(s) (seed {args.seed}, P in {sorted({c.world for c in cases})})", flush=True)
    start = time.perf_counter()
    results = sweep(cases, args.per_launch, args.check_timeout, max_failed=args.max_failed)
    print(summary(results, time.perf_counter() - start))
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
