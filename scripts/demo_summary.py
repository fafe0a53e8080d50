"""The closing summary of ``scripts/demo.sh``: what the run did and where its files are.

    python scripts/demo_summary.py --run dmuon=outputs/demo/dmuon.log [--run adamw=...] \
        [--toml train_configs/llama3_debug_dmuon.toml] [--steps N] [--plot outputs/demo/loss_dmuon_vs_adamw.png]

Reads each run's own console log (rank 0's TorchTitan output, as ``demo.sh`` tees it):
the steps run, the first and last training loss, the first and last validation loss,
and the checkpoint folder TorchTitan announced (if it checkpointed). ``summarise`` does
the work on log text, so tests can call it on a sample.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# TorchTitan 0.2.2's checkpoint.py, when [checkpoint] enable = true.
_CHECKPOINTS = re.compile(r"Checkpoints will be loaded from and saved to (?P<folder>\S+)")
_COMPLETED = "Training completed"
_COMPARE_PLOT = "outputs/demo/loss_dmuon_vs_adamw.png"


def _load_titan_log():
    # By path, as scripts/compare.py does: importing torchtitan_ext would import TorchTitan.
    if "titan_log" in sys.modules:
        return sys.modules["titan_log"]
    spec = importlib.util.spec_from_file_location("titan_log", REPO / "torchtitan_ext/titan_log.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["titan_log"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _first_last(losses: dict[int, float]) -> str:
    first, last = min(losses), max(losses)
    return f"{losses[first]:.4f} at step {first} -> {losses[last]:.4f} at step {last}"


def summarise_run(name: str, text: str, log_path: str, steps: int | None = None,
                  ranks_dir: str | None = None) -> tuple[list[str], str | None]:
    """Lines for one run from its console text, and the checkpoint folder TorchTitan
    announced (None: it did not checkpoint). ``steps``: the steps the run was asked for,
    reported as run only after TorchTitan's "Training completed" (else the last step line
    is the evidence). ``ranks_dir``: where every rank's output went, if anywhere."""
    log = _load_titan_log().parse_log(text)
    if not log.train_loss:
        return [f"{name}: no step lines in {log_path}; did the run fail?"], None
    last_logged = max(log.train_loss)
    if _COMPLETED in text and steps is not None and steps >= last_logged:
        ran = f"{steps} steps, completed"
    else:
        ran = f"{last_logged} steps by its last step line"
    val = _first_last(log.val_loss) if log.val_loss else "none (validation off)"
    ranks = f" (rank 0; every rank's: {ranks_dir})" if ranks_dir else " (rank 0)"
    folder = _CHECKPOINTS.search(text)
    lines = [
        f"{name}: {ran}",
        f"  train loss       {_first_last(log.train_loss)}",
        f"  validation loss  {val}",
        f"  log              {log_path}{ranks}",
    ]
    return lines, folder["folder"] if folder else None


def summarise(runs: dict[str, tuple[str, str]], steps: int | None = None, plot: str | None = None,
              ranks_dirs: dict[str, str] | None = None) -> str:
    """The summary of ``runs`` (name -> (log text, log path)); ``plot``: the loss plot
    this run wrote, or None (the summary then names the command that writes one);
    ``ranks_dirs``: name -> the folder of every rank's output."""
    lines, checkpoints = ["== summary"], {}
    for name, (text, path) in runs.items():
        run_lines, folder = summarise_run(name, text, path, steps, (ranks_dirs or {}).get(name))
        lines += run_lines
        if folder:
            checkpoints[name] = folder
    if checkpoints:
        lines += [f"checkpoints of {name}: {folder}" for name, folder in checkpoints.items()]
    else:
        lines.append("checkpoints: none written ([checkpoint] enable = false in the TOML)")
    if plot:
        lines.append(f"loss plot: {plot} (numbers: {Path(plot).with_name('summary.txt')})")
    else:
        lines.append(f"loss plot: none from this run; bash scripts/demo.sh --compare writes {_COMPARE_PLOT}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Summarise scripts/demo.sh's runs from their logs.")
    parser.add_argument("--run", action="append", required=True, metavar="NAME=LOG", help="a run's console log (repeatable)")
    parser.add_argument("--toml", type=Path, default=None, help="the runs' TOML: [training] steps, unless --steps")
    parser.add_argument("--steps", type=int, default=None, help="the steps each run was asked for")
    parser.add_argument("--plot", default=None, help="the loss plot this run wrote")
    args = parser.parse_args()
    runs, ranks_dirs = {}, {}
    for item in args.run:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--run {item!r}: expected NAME=LOG")
        runs[name] = (Path(path).read_text(errors="replace"), path)
        ranks = Path(path).with_name(Path(path).stem + "_ranks")  # demo.sh's torchrun --log-dir
        if ranks.is_dir():
            ranks_dirs[name] = f"{ranks}/"
    steps = args.steps
    if steps is None and args.toml is not None:
        steps = tomllib.loads(args.toml.read_text()).get("training", {}).get("steps")
    plot = args.plot if args.plot and Path(args.plot).is_file() else None
    print(summarise(runs, steps, plot, ranks_dirs))


if __name__ == "__main__":
    main()
