"""The replay guard's host time: ``ReplayGuard.check()`` runs before every replay of a captured
step (``dmuon.capture.cuda_graphs``), so its cost is host time a captured step exists to save.

Run from the repository root::

    python -m benchmarks.replay_guard [--params 400] [--repeats 2000] [--against REV]

A capturable DMuon on CPU tensors (the guard's work is host work: identities and storage
addresses, the groups' options) with ``--params`` Muon matrices, each guarded with its grad
and momentum (3 tensors a parameter: 400 give llama3 8B's ~1,200), stepped once so its state
exists. It prints the median and 90th percentile of ``check()`` over ``--repeats`` calls, and
with ``--against REV`` the same for the guard of that git revision (``git show
REV:dmuon/capture/replay_guard.py``), measured alternately in the same process.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from dmuon import DMuon, ReplayGuard


def guarded_optimizer(params: int) -> DMuon:
    """A capturable DMuon with ``params`` small matrices, grads and momenta: 3 tensors each."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 4, generator=generator)) for _ in range(params)]
    optimizer = DMuon([{"params": [(f"layers.{i}.w", w) for i, w in enumerate(weights)], "use_muon": True}],
                      lr=0.02, capturable=True)
    for w in weights:
        w.grad = torch.randn(4, 4, generator=generator)
    optimizer.step()
    return optimizer


def guard_of_revision(revision: str) -> ModuleType:
    """``dmuon/capture/replay_guard.py`` as it was at ``revision``, imported as a module of its own
    (a revision from after dmuon's top level went into folders: an older guard imports modules
    by their old names)."""
    source = subprocess.run(["git", "show", f"{revision}:dmuon/capture/replay_guard.py"], check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp()) / "replay_guard_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("replay_guard_then", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timings(guard, repeats: int) -> list[float]:
    """Milliseconds of ``guard.check()``, ``repeats`` times."""
    found = []
    for _ in range(repeats):
        start = time.perf_counter()
        guard.check()
        found.append((time.perf_counter() - start) * 1e3)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=400, help="Muon matrices (3 guarded tensors each)")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--against", help="a git revision whose guard is timed alongside")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    optimizer = guarded_optimizer(args.params)
    guards = {"this tree": ReplayGuard(optimizer)}
    if args.against:
        guards[args.against] = guard_of_revision(args.against).ReplayGuard(optimizer)
    found: dict[str, list[float]] = {name: [] for name in guards}
    for _ in range(5):  # alternated, so a slow moment of the machine falls on both
        for name, guard in guards.items():
            found[name] += timings(guard, args.repeats // 5)
    tensors = sum(1 for _ in guards["this tree"]._held)
    print(f"ReplayGuard.check() on {tensors} guarded tensors ({args.params} Muon matrices), torch "
          f"{torch.__version__}, {args.repeats} calls each:")
    for name, times in found.items():
        times.sort()
        print(f"  {name:>12}: median {statistics.median(times):.3f} ms, p90 {times[int(0.9 * len(times))]:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
