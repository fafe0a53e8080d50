"""``python -m tests.mutants``: plant each curated mutant in a scratch copy, run its tests, report.

    python -m tests.mutants                       # every mutant, two at a time (one per core)
    python -m tests.mutants --only NAME [NAME ...]
    python -m tests.mutants --touching dmuon/exchange/status_masks.py   # the mutants of changed files
    python -m tests.mutants --list

A mutant is killed when its tests fail (or outlive its timeout: a hang the suite noticed),
survives when they pass. Each worker owns one scratch copy of the working tree (tracked and
untracked files, not ignored ones), plants a mutant, runs ``pytest -x`` on the mutant's tests
there with one thread, and puts the file back. Exits 1 when a mutant survived or no longer
applies (its ``old`` text is gone: update the catalogue), 0 when every one was killed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests import launch
from tests.mutants import Mutant, catalogue

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # "killed", "killed (timeout)", "survived", "stale"
    seconds: float
    detail: str  # the first failing test, or why


def working_tree_files(repo: Path) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                            capture_output=True).stdout.decode()
    return [path for path in listed.split("\0") if path and (repo / path).is_file()]


def make_scratch(repo: Path, root: Path) -> Path:
    """A copy of the working tree under ``root`` (no environments, no build outputs)."""
    for path in working_tree_files(repo):
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / path, target)
    return root


def first_failure(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)
    if found:
        return found.group(1)
    tail = [line for line in output.strip().splitlines() if line.strip()]
    return tail[-1][:160] if tail else "(no output)"


def run_one(mutant: Mutant, scratch: Path) -> Outcome:
    """Plant ``mutant`` in ``scratch``, run its tests there, put the file back."""
    target = scratch / mutant.path
    original = target.read_text()
    if original.count(mutant.old) != 1:
        return Outcome(mutant, "stale", 0.0, f"its old text occurs {original.count(mutant.old)} times in {mutant.path}")
    target.write_text(original.replace(mutant.old, mutant.new))
    env = dict(os.environ, PYTHONPATH=str(scratch), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfE", *mutant.tests]
    start = time.monotonic()
    try:
        proc = launch.run(cmd, timeout_s=mutant.timeout_s, cwd=scratch, env=env)
    except launch.LaunchTimedOut:
        return Outcome(mutant, "killed (timeout)", time.monotonic() - start, f"over {mutant.timeout_s} s")
    finally:
        target.write_text(original)
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return Outcome(mutant, "survived", seconds, "its tests passed")
    if proc.returncode in (4, 5):  # usage error, or no test collected: the selection is stale
        return Outcome(mutant, "stale", seconds, f"pytest exit {proc.returncode}: {first_failure(proc.stdout)}")
    return Outcome(mutant, "killed", seconds, first_failure(proc.stdout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutants only")
    parser.add_argument("--touching", nargs="+", metavar="PATH", help="the mutants of these files only")
    parser.add_argument("--jobs", type=int, default=2, help="mutants at a time, one scratch copy each (default 2)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    mutants = catalogue()
    if args.only:
        unknown = set(args.only) - {m.name for m in mutants}
        if unknown:
            parser.error(f"no mutant named {sorted(unknown)}")
        mutants = [m for m in mutants if m.name in args.only]
    if args.touching:
        mutants = [m for m in mutants if m.path in {os.path.normpath(p) for p in args.touching}]
    if args.list:
        for m in mutants:
            print(f"{m.name:<48} {m.path:<44} {m.guarantee}")
        return 0
    print(f"{len(mutants)} mutants, {args.jobs} at a time", flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dmuon-mutants-") as tmp:
        scratches = [make_scratch(REPO, Path(tmp) / f"tree{k}") for k in range(max(1, min(args.jobs, len(mutants))))]
        free = list(scratches)

        def work(mutant: Mutant) -> Outcome:
            scratch = free.pop()
            try:
                outcome = run_one(mutant, scratch)
            finally:
                free.append(scratch)
            print(f"{outcome.verdict:<17} {outcome.seconds:6.1f} s  {mutant.name:<48} {outcome.detail}", flush=True)
            return outcome

        with ThreadPoolExecutor(max_workers=len(scratches)) as pool:
            outcomes = list(pool.map(work, mutants))
    killed = sum(o.verdict.startswith("killed") for o in outcomes)
    print(f"\nkilled {killed} of {len(outcomes)} in {time.monotonic() - start:.0f} s "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} cores)")
    for outcome in outcomes:
        if not outcome.verdict.startswith("killed"):
            print(f"  {outcome.verdict}: {outcome.mutant.name} ({outcome.mutant.path}): {outcome.detail}")
    return 0 if killed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
