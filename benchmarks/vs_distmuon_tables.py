"""The Markdown tables ``python -m benchmarks.vs_distmuon`` prints: bytes and
Newton-Schulz balance from shapes, and a training step's bytes.
"""

from __future__ import annotations


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

