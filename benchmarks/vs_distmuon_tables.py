"""The Markdown tables ``python -m benchmarks.vs_distmuon`` prints: the computed ones
(bytes and Newton-Schulz balance from shapes; a training step's bytes) and, with
``--time``, the measured one with the facts it was measured under.
"""

from __future__ import annotations

from benchmarks.vs_distmuon_peers import HYPERPARAMETERS

# How the measured table names each optimizer.
LABELS = {"dmuon": "DMuon", "distmuon": "DistMuon (TorchTitan 0.3)", "dion": "Dion Muon",
          "dtensor_muon": "dtensor-muon Muon"}


# ---------------------------------------------------------------- computed

def _gb(n: int) -> str:
    return f"{n / 1e9:.3f}"


def compare_table(rows: list[dict]) -> str:
    lines = [
        "| model | P | optimizer | exchange dtype | GB/rank | vs DMuon | NS max/mean | NS critical path/mean |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    labels = (("distmuon_per_layer", "DistMuon, a bucket per block", "fp32 (storage)"),
              ("distmuon_one_bucket", "DistMuon, one bucket", "fp32 (storage)"),
              ("dmuon", "DMuon", "bf16"),
              ("dmuon_gram", "DMuon, ns_algorithm=auto (Gram)", "bf16"))
    for row in rows:
        ours = row["dmuon"]["bytes_per_rank_max"]
        for key, label, dtype in labels:
            figures = row[key]
            lines.append(
                f"| {row['model']} | {row['world_size']} | {label} | {dtype} | {_gb(figures['bytes_per_rank_max'])} "
                f"| {figures['bytes_per_rank_max'] / ours:.3f}x | {figures['ns_max_over_mean']:.3f} "
                f"| {figures['ns_critical_over_mean']:.3f} |")
    return "\n".join(lines)


def step_table(rows: list[dict]) -> str:
    lines = [
        "| model | P | FSDP all-gather fwd + bwd (bf16) | reduce-scatter (fp32) | AdamW step | DMuon exchange "
        "| DMuon step | DMuon / AdamW | with a bf16 all-gather of every matrix instead |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['world_size']} | {_gb(row['all_gather_forward'] + row['all_gather_backward'])} "
            f"| {_gb(row['reduce_scatter'])} | {_gb(row['adamw_step'])} | {_gb(row['dmuon_exchange'])} "
            f"| {_gb(row['dmuon_step'])} | {row['ratio']:.4f} | {row['allgather_muon_ratio']:.4f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- measured (--time)

def _difference(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def timed_table(report: dict) -> str:
    """One row per world size and optimizer (``benchmarks.vs_distmuon_time.run_timed``'s report)."""
    settings = report["settings"]
    lines = [
        f"| P | optimizer | step ms (median of {settings['steps']}) | floor ms (one rank / P) | efficiency "
        "| bytes sent per rank (max) | max abs diff vs torch.optim.Muon (3 steps) | bitwise |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for world in report["worlds"]:
        for row in world["rows"]:
            lines.append(
                f"| {row['world_size']} | {LABELS[row['optimizer']]} | {row['step_ms']:.1f} | {row['floor_ms']:.1f} "
                f"| {row['efficiency']:.2f} | {row['bytes_sent_max']:,} | {_difference(row['max_abs_diff'])} "
                f"| {'yes' if row['bitwise'] else 'no'} |")
    return "\n".join(lines)


def timed_header(report: dict) -> str:
    """The command, date, machine, stack and hyperparameters of a measured table."""
    m, s = report["machine"], report["settings"]
    load = ", ".join(f"{x:.2f}" for x in m["load_average_1_5_15"])
    lines = [f"command: {report['command']}", f"date: {report['date']}",
             f"machine: {m['cpu_model']}, {m['cores']} cores, CPU capability {m['cpu_capability']} (native bf16 "
             f"matmul: {'yes' if m['native_bf16_matmul'] else 'no'}), load average {load} at the start; "
             f"{m['threads_per_rank']} thread per rank",
             f"versions: torch {m['torch']}, TorchTitan {m['torchtitan']}, Python {m['python']}",
             f"stack: {s['blocks']} llama3-shaped blocks of width {s['width']}, FSDP2 Shard(0) on P gloo ranks; "
             f"{s['warmup']} warm-up steps, {s['steps']} timed",
             "hyperparameters (every optimizer): " + ", ".join(f"{k}={v}" for k, v in HYPERPARAMETERS.items())]
    lines += [f"{LABELS[name]}: {reason}" for name, reason in report["skipped"].items()]
    return "\n".join(lines)
