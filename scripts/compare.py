"""Plot and summarise TorchTitan runs from their logs: DMuon against its AdamW
baseline, or any runs by name.

    python scripts/compare.py --dmuon outputs/demo/dmuon.log --adamw outputs/demo/adamw.log \
        --out outputs/demo
    python scripts/compare.py --run standard=outputs/demo/ns_standard.log \
        --run auto=outputs/demo/ns_auto.log --name loss_ns_algorithms --out outputs/demo
    python scripts/compare.py --run fp32=... --run int8=... --relative-to fp32 --out outputs/demo

Writes ``<out>/<name>.png`` (training and validation loss of the runs, and with
``--relative-to`` each run's validation loss minus one run's; default name
``loss_dmuon_vs_adamw``) and ``<out>/summary.txt`` (final losses and steps/s), and prints
the summary. Each log is the console output of one ``torchrun --local-ranks-filter 0`` run.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
# One color a run, in the order given: at most this many runs in one plot.
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _load_titan_log():
    # Load the parser by path: importing the torchtitan_ext package would pull in
    # all of TorchTitan (seconds) just to read two text files.
    spec = importlib.util.spec_from_file_location("titan_log", REPO / "torchtitan_ext/titan_log.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["titan_log"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _smooth(values: list[float], alpha: float = 0.2) -> list[float]:
    """Exponential moving average, to read trends through per-batch noise."""
    out, ema = [], None
    for v in values:
        ema = v if ema is None else (1 - alpha) * ema + alpha * v
        out.append(ema)
    return out


def summarise(runs: dict) -> str:
    lines = []
    for name, log in runs.items():
        last = max(log.train_loss)
        val = f"{log.val_loss[max(log.val_loss)]:.4f} (step {max(log.val_loss)})" if log.val_loss else "n/a"
        lines.append(
            f"{name:11s} final train loss {log.train_loss[last]:.4f} (step {last})  "
            f"final val loss {val}  {log.steps_per_second():.3f} steps/s"
        )
    if {"DMuon", "AdamW"} <= runs.keys():
        d, a = runs["DMuon"], runs["AdamW"]
        if d.val_loss and a.val_loss:
            diff = d.val_loss[max(d.val_loss)] - a.val_loss[max(a.val_loss)]
            lines.append(f"DMuon - AdamW final val loss: {diff:+.4f}")
        lines.append(f"DMuon / AdamW speed: {d.steps_per_second() / a.steps_per_second():.2f}x")
    return "\n".join(lines)


def plot(runs: dict, path: Path, title: str, relative_to: str | None = None) -> None:
    """Training (EMA over the raw curve) and validation loss side by side; with
    ``relative_to``, a third panel of each run's validation loss minus that run's."""
    panels = 3 if relative_to else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    ax_train, ax_val = axes[0], axes[1]
    for (name, log), color in zip(runs.items(), COLORS):
        steps = sorted(log.train_loss)
        losses = [log.train_loss[s] for s in steps]
        ax_train.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax_train.plot(steps, _smooth(losses), color=color, label=f"{name} (EMA)")
        vsteps = sorted(log.val_loss)
        ax_val.plot(vsteps, [log.val_loss[s] for s in vsteps], "o-", color=color, label=name)
        if relative_to:
            base = runs[relative_to].val_loss
            shared = [s for s in vsteps if s in base]
            axes[2].plot(shared, [log.val_loss[s] - base[s] for s in shared], "o-", color=color, label=name)
    ax_train.set(title="training loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax_val.set(title="validation loss (held-out pydoc split)", xlabel="step")
    if relative_to:
        axes[2].set(title=f"validation loss minus {relative_to}'s", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"llama3 debug model, 2 CPU ranks (FSDP2/gloo): {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description="Compare TorchTitan runs (DMuon and AdamW, or any by name).")
    parser.add_argument("--dmuon", type=Path, help="log of the DMuon run")
    parser.add_argument("--adamw", type=Path, help="log of the AdamW run")
    parser.add_argument("--run", action="append", default=[], metavar="LABEL=LOG", help="a run by name (repeatable)")
    parser.add_argument("--name", default="loss_dmuon_vs_adamw", help="the PNG's file name, without .png")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNG and summary")
    parser.add_argument("--relative-to", default=None, metavar="LABEL",
                        help="add a panel of each run's validation loss minus this run's")
    args = parser.parse_args()

    logs = {label: path for label, path in (("DMuon", args.dmuon), ("AdamW", args.adamw)) if path is not None}
    for item in args.run:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            parser.error(f"--run {item!r}: expected LABEL=LOG, e.g. --run standard=outputs/demo/ns_standard.log")
        logs[label] = Path(path)
    if not 1 <= len(logs) <= len(COLORS):
        parser.error(f"give one to {len(COLORS)} runs (--dmuon, --adamw, --run LABEL=LOG)")
    titan_log = _load_titan_log()
    runs = {label: titan_log.parse_log(path.read_text()) for label, path in logs.items()}
    for name, log in runs.items():
        if not log.train_loss:
            raise SystemExit(f"no step lines found in the {name} log; did the run fail?")
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{args.name}.png"
    if args.relative_to is not None and args.relative_to not in runs:
        parser.error(f"--relative-to {args.relative_to!r}: not one of the runs {list(runs)}")
    plot(runs, png, " vs ".join(runs), args.relative_to)
    summary = summarise(runs) + f"\nplot: {png}\n"
    (args.out / "summary.txt").write_text(summary)
    print(summary, end="")


if __name__ == "__main__":
    main()
