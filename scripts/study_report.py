"""Compare several TorchTitan runs against a baseline: losses, leading steps, steps to reach.

    python scripts/study_report.py --out docs/study \
        --run AdamW=outputs/study/adamw.log --run "DMuon original=outputs/study/original.log" ...

The first ``--run`` is the baseline (AdamW). Writes, under ``--out``:

- ``losses.png``: smoothed training loss and validation loss of every run;
- ``leading_steps.png``: for each baseline step, how many steps earlier each other run
  reached the baseline's loss: smoothed training loss (left) and validation loss
  (right; ``scripts/leading_steps.py`` explains why both);
- ``report.md``: one row per run (final losses, steps/s, the step at which it reached the
  baseline's final validation loss), and both leading-steps tables (training loss every
  ``--every`` steps, validation loss at every validation);
- ``max_logits.png`` and a table in ``report.md``, for the runs whose step lines carry
  the largest attention logit (DMuon with ``track_max_logits`` or QK-clip): that logit
  per step, and the heads clipped.

Each log is the console output of one ``torchrun --local-ranks-filter 0`` run with
``--metrics.log_freq 1`` (``scripts/study.sh`` writes them).
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


def _load(name: str, path: Path):
    # By path: importing the torchtitan_ext package would pull in all of TorchTitan.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


titan_log = _load("titan_log", REPO / "torchtitan_ext" / "titan_log.py")
leading = _load("leading_steps", Path(__file__).resolve().parent / "leading_steps.py")


def _final(losses: dict[int, float]) -> str:
    return f"{losses[max(losses)]:.4f}" if losses else "n/a"


def summary_table(runs: dict, window: int) -> list[str]:
    (base_name, base), *_ = runs.items()
    target = base.val_loss[max(base.val_loss)] if base.val_loss else None
    last_step = max(base.train_loss)
    lines = [
        f"| run | final train loss ({window}-step mean) | final val loss | steps/s | "
        f"first validation at or below {base_name}'s final val loss | interpolated step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, log in runs.items():
        smoothed = leading.moving_average(log.train_loss, window)
        reached, estimate = leading.steps_to_reach(log.val_loss, target) if target is not None else (None, None)
        reach = "not reached" if reached is None else f"step {reached}"
        est = "-" if estimate is None else f"{estimate:.0f} ({estimate / last_step:.0%} of {last_step})"
        lines.append(f"| {name} | {smoothed[max(smoothed)]:.4f} | {_final(log.val_loss)} | "
                     f"{log.steps_per_second():.3f} | {reach} | {est} |")
    return lines


def leading_table(runs: dict, window: int, every: int) -> tuple[list[str], dict[str, dict]]:
    (base_name, base), *others = runs.items()
    results = {name: leading.leading_steps(base.train_loss, log.train_loss, window) for name, log in others}
    smoothed = leading.moving_average(base.train_loss, window)
    rows = [s for s in sorted(base.train_loss) if s % every == 0]
    lines = [
        f"| {base_name} step | {base_name} loss ({window}-step mean) | " + " | ".join(results) + " |",
        "| --- | --- | " + " | ".join("---" for _ in results) + " |",
    ]
    for step in rows:
        cells = ["never" if results[n][step] is None else str(results[n][step]) for n in results]
        lines.append(f"| {step} | {smoothed[step]:.4f} | " + " | ".join(cells) + " |")
    return lines, results


def validation_leading_table(runs: dict) -> tuple[list[str], dict[str, dict]]:
    (base_name, base), *others = runs.items()
    results = {name: leading.leading_steps_on_samples(base.val_loss, log.val_loss) for name, log in others}
    lines = [
        f"| {base_name} validation step | {base_name} val loss | " + " | ".join(results) + " |",
        "| --- | --- | " + " | ".join("---" for _ in results) + " |",
    ]
    for step in sorted(base.val_loss):
        cells = ["never" if results[n][step] is None else str(round(results[n][step])) for n in results]
        lines.append(f"| {step} | {base.val_loss[step]:.4f} | " + " | ".join(cells) + " |")
    return lines, results


def plot_losses(runs: dict, window: int, path: Path, title: str) -> None:
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.4))
    for name, log in runs.items():
        smoothed = leading.moving_average(log.train_loss, window)
        (line,) = ax_train.plot(list(smoothed), list(smoothed.values()), label=name)
        vsteps = sorted(log.val_loss)
        ax_val.plot(vsteps, [log.val_loss[s] for s in vsteps], "o-", markersize=3, color=line.get_color(), label=name)
    ax_train.set(title=f"training loss ({window}-step trailing mean)", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax_val.set(title="validation loss (held-out pydoc split)", xlabel="step")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_train.set_ylim(top=min(8.0, ax_train.get_ylim()[1]))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def logit_runs(runs: dict) -> dict:
    """The runs whose step lines carry the largest attention logit."""
    return {name: log for name, log in runs.items()
            if any("max_logit" in figures for figures in log.telemetry.values())}


def logit_table(runs: dict, every: int) -> list[str]:
    """The largest logit (and clipped heads) every ``every`` steps, and the run's maximum."""
    names = list(runs)
    steps = sorted({s for log in runs.values() for s in log.telemetry if s == 1 or s % every == 0})
    lines = ["| step | " + " | ".join(f"{n}: max logit (clipped heads)" for n in names) + " |",
             "| --- | " + " | ".join("---" for _ in names) + " |"]

    def cell(log, step):
        figures = log.telemetry.get(step, {})
        if "max_logit" not in figures:
            return "-"
        return f"{figures['max_logit']:.2f} ({figures['qk_clipped_heads']:.0f})"

    for step in steps:
        lines.append(f"| {step} | " + " | ".join(cell(runs[n], step) for n in names) + " |")
    peaks = [max(f["max_logit"] for f in runs[n].telemetry.values() if "max_logit" in f) for n in names]
    lines.append("| max over the run | " + " | ".join(f"{p:.2f}" for p in peaks) + " |")
    return lines


def plot_logits(runs: dict, path: Path, title: str) -> None:
    fig, (ax_logit, ax_clipped) = plt.subplots(1, 2, figsize=(12, 4.4))
    for name, log in runs.items():
        steps = sorted(s for s, f in log.telemetry.items() if "max_logit" in f)
        (line,) = ax_logit.plot(steps, [log.telemetry[s]["max_logit"] for s in steps], label=name)
        ax_clipped.plot(steps, [log.telemetry[s]["qk_clipped_heads"] for s in steps], color=line.get_color(),
                        label=name)
    ax_logit.set(title="largest attention logit of the step (all ranks, before clipping)", xlabel="step",
                 ylabel="max q.k / sqrt(d)")
    ax_clipped.set(title="heads clipped by QK-clip", xlabel="step", ylabel="heads")
    for ax in (ax_logit, ax_clipped):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_leading(train: dict[str, dict], val: dict[str, dict], base_name: str, window: int, path: Path,
                 title: str) -> None:
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for name in train:
        steps = [s for s, v in sorted(train[name].items()) if v is not None]
        (line,) = ax_train.plot(steps, [train[name][s] for s in steps], label=name)
        vsteps = [s for s, v in sorted(val[name].items()) if v is not None]
        ax_val.plot(vsteps, [val[name][s] for s in vsteps], "o-", markersize=3, color=line.get_color(), label=name)
    ax_train.set(title=f"on training loss ({window}-step trailing mean of both)",
                 xlabel=f"{base_name} step s", ylabel=f"s - first step reaching {base_name}'s loss at s")
    ax_val.set(title="on validation loss (interpolated between validations)", xlabel=f"{base_name} step s")
    for ax in (ax_train, ax_val):
        ax.axhline(0, color="black", linewidth=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"leading steps over {base_name}: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, metavar="NAME=LOG",
                        help="a run's name and log; the first is the baseline")
    parser.add_argument("--out", type=Path, required=True, help="folder for the plots and report.md")
    parser.add_argument("--window", type=int, default=20, help="trailing mean window (steps) for training losses")
    parser.add_argument("--every", type=int, default=20, help="leading-steps table: one row every N steps")
    parser.add_argument("--title", default="llama3 debug model, 2 CPU ranks (FSDP2/gloo), embedded pydoc corpus")
    args = parser.parse_args()

    runs = {}
    for item in args.run:
        name, _, path = item.partition("=")
        log = titan_log.parse_log(Path(path).read_text())
        if not log.train_loss:
            raise SystemExit(f"no step lines in {path} ({name}); did the run fail?")
        runs[name] = log
    if len(runs) < 2:
        raise SystemExit("need a baseline and at least one other run")
    args.out.mkdir(parents=True, exist_ok=True)
    base_name = next(iter(runs))
    table, results = leading_table(runs, args.window, args.every)
    val_table, val_results = validation_leading_table(runs)
    plot_losses(runs, args.window, args.out / "losses.png", args.title)
    plot_leading(results, val_results, base_name, args.window, args.out / "leading_steps.png", args.title)
    report = "\n".join([
        f"## Runs (baseline: {base_name})", "", *summary_table(runs, args.window), "",
        f"## Leading steps over {base_name}, on validation loss", "", *val_table, "",
        f"## Leading steps over {base_name}, on training loss ({args.window}-step trailing mean)", "", *table, "",
    ])
    with_logits = logit_runs(runs)
    if with_logits:
        plot_logits(with_logits, args.out / "max_logits.png", args.title)
        report += "\n".join(["", "## Largest attention logit per step", "", *logit_table(with_logits, args.every), ""])
    (args.out / "report.md").write_text(report)
    print(report, end="")


if __name__ == "__main__":
    main()
