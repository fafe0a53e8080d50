"""What the step benchmark shows of a run: the table it prints, the JSON and the PNG chart
it writes (``--json``, ``--plot``).
"""

from __future__ import annotations

import json

from dmuon.tools import DEFAULT_NS_ALGORITHM


def write_report(report: dict, json_path: str | None, plot_path: str | None) -> None:
    """Print the table of ``report``; write it as JSON to ``json_path`` and as a chart to
    ``plot_path``, each when given (rank 0 calls this)."""
    print(format_table(report), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}", flush=True)
    if plot_path:
        plot_report(report, plot_path)
        print(f"wrote {plot_path}", flush=True)


def format_table(report: dict) -> str:
    """A plain-text table of a benchmark report."""
    results = report["results"]
    vanilla = results.get("vanilla", {}).get("step_ms")
    lines = [
        f"world size {report['world_size']}, {report['device']}, {report['threads_per_rank']} thread(s)/rank, "
        f"Muon elements N = {report['muon_elements']:,}, layout {report['layout']} on mesh {report['mesh_shape']}, "
        f"DMuon ns_algorithm {report.get('ns_algorithm', DEFAULT_NS_ALGORITHM)}",
        f"{'optimizer':<14}{'NS dtype':>10}{'step ms':>10}{'vs vanilla':>12}{'bytes sent/rank':>18}",
    ]
    for name, row in results.items():
        # Only a row whose Newton-Schulz runs in bf16, as vanilla's does, is compared with it.
        comparable = vanilla and row.get("ns_dtype") in ("bfloat16", None)
        speedup = f"{vanilla / row['step_ms']:.2f}x" if comparable else "-"
        lines.append(f"{name:<14}{row.get('ns_dtype') or '-':>10}{row['step_ms']:>10.1f}{speedup:>12}"
                     f"{row['bytes_sent_per_rank']:>18,}")
    lines += [f"{name:<14}{'left out':>10}: {reason}" for name, reason in report.get("left_out", {}).items()]
    lines.append(f"owner-exchange minimum for this layout = {report['min_bytes_per_rank']:,} bytes/rank "
                 f"(dmuon.tools.plan_report.min_bytes_per_rank)")
    dmuon = results.get("dmuon", {})
    if "ns_flops_per_rank_max" in dmuon:
        ideal = report["ns_flops_total"] / report["world_size"]
        lines.append(f"dmuon: {dmuon['batches']} batch(es) (max_batch_numel {report['max_batch_numel']:,}), "
                     f"Newton-Schulz GFLOP on the busiest rank {dmuon['ns_flops_per_rank_max'] / 1e9:.2f} "
                     f"= {dmuon['ns_flops_per_rank_max'] / ideal:.2f} x total/P")
    if "parallel_efficiency" in report:
        lines.append(f"parallel efficiency single / (P * dmuon) = {report['parallel_efficiency']:.2f}")
    rates = report.get("ns_throughput_gflops")
    if rates:
        dim = report.get("dim", "dim")
        lines.append(f"Newton-Schulz on one {dim} x {dim} matrix, rank 0: "
                     + ", ".join(f"{name} {rate:.1f} GFLOP/s" for name, rate in rates.items())
                     + f" (fp32 / bf16 = {rates['float32'] / rates['bfloat16']:.2f})")
    return "\n".join(lines)


def plot_report(report: dict, path: str) -> None:
    """Two bar charts side by side: median step time and bytes sent per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    step_ms = [report["results"][n]["step_ms"] for n in names]
    mbytes = [report["results"][n]["bytes_sent_per_rank"] / 1e6 for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, step_ms, color="tab:blue")
    left.set_ylabel("median step (ms, slowest rank)")
    right.bar(names, mbytes, color="tab:orange")
    right.axhline(report["min_bytes_per_rank"] / 1e6, color="black", linestyle="--", linewidth=1,
                  label="owner-computed minimum 4N(P-1)/P²")
    right.set_ylabel("MB sent per rank per step")
    right.legend(fontsize=8, loc="center left")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=20)
    fig.suptitle(f"benchmarks.bench: {report['world_size']} rank(s), {report['device']}, "
                 f"N = {report['muon_elements'] / 1e6:.1f}M Muon elements", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
