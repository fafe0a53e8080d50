"""Newton-Schulz throughput on one device, next to the device's own bf16 matmul rate.

    python -m benchmarks.ns_throughput --device cuda          # llama3 8B / 70B matrix shapes
    python -m benchmarks.ns_throughput --device cpu --shapes 256x1024 --repeats 2
    # standard vs Gram Newton-Schulz, fp32, one thread, and a DMuon step at P = 1 of each:
    python -m benchmarks.ns_throughput --device cpu --threads 1 --ns-dtype float32 \
        --algorithms standard gram --shapes cpu-llama --dmuon-step

For each shape: the time of ``dmuon.numerics.newton_schulz.orthogonalize`` (5 steps, bf16 on an
accelerator), its TFLOP/s by ``newton_schulz_flops``, and that as a fraction of the
TFLOP/s of one large bf16 matmul on the same device (the achievable peak, measured
here rather than taken from a datasheet). ``--peak-tflops`` adds the fraction of a
datasheet figure. With several ``--algorithms`` (``ns_algorithm``: standard, gram,
auto) each shape is timed under each, with its speedup over the first and the ratio of
their flops (what the speedup should approach); ``--dmuon-step`` also times one
``DMuon.step()`` on a parameter of that shape (one process) under each.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dmuon import DMuon, orthogonalize
from dmuon.tools import (DEFAULT_NS_DTYPE, newton_schulz_flops, NS_ALGORITHMS, NS_DTYPE_CHOICES, resolve_ns_algorithm, resolve_ns_dtype, STANDARD)

# llama3 8B's Muon matrices (wq/wo, wk/wv, w1/w3, w2) and 70B's MLP: rows x cols.
DEFAULT_SHAPES = ("4096x4096", "1024x4096", "14336x4096", "4096x14336", "28672x8192")
# The same aspects (1, 4 and 3.5, wide and tall) at a quarter of 8B's width: seconds per
# call in fp32 on one CPU thread. ``--shapes cpu-llama`` names them.
CPU_LLAMA_SHAPES = ("1024x1024", "256x1024", "1024x256", "3584x1024", "1024x3584")
SHAPE_SETS = {"llama": DEFAULT_SHAPES, "cpu-llama": CPU_LLAMA_SHAPES}
# The matmul that measures the device's achievable bf16 rate.
PEAK_MATMUL = 8192


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_tflops(device: torch.device, size: int, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    return 2 * size**3 / timed(lambda: a @ b, device, repeats) / 1e12


def dmuon_step_seconds(shape: tuple[int, int], device: torch.device, ns_dtype: str, algorithm: str,
                       repeats: int) -> float:
    """Median seconds of one ``DMuon.step()`` on a single parameter of ``shape`` (one process)."""
    param = torch.nn.Parameter(torch.randn(shape, device=device))
    param.grad = torch.randn(shape, device=device)
    optimizer = DMuon([param], ns_dtype=ns_dtype, ns_algorithm=algorithm)
    return timed(optimizer.step, device, repeats)


def measure(device: torch.device, shapes: list[tuple[int, int]], repeats: int, peak_size: int,
            ns_dtype: str = DEFAULT_NS_DTYPE, algorithms: tuple[str, ...] = (STANDARD,),
            dmuon_step: bool = False) -> dict:
    dtype = resolve_ns_dtype(ns_dtype, device.type)
    peak = matmul_tflops(device, peak_size, repeats)
    rows = []
    for shape in shapes:
        update = torch.randn(shape, device=device, dtype=torch.bfloat16)
        row: dict = {"shape": f"{shape[0]}x{shape[1]}"}
        for algorithm in algorithms:
            seconds = timed(lambda: orthogonalize(update, dtype=dtype, algorithm=algorithm), device, repeats)
            flops = newton_schulz_flops(shape, algorithm=resolve_ns_algorithm(algorithm, dtype, device.type))
            tflops = flops / seconds / 1e12
            key = "" if len(algorithms) == 1 else f"{algorithm}_"
            row |= {f"{key}ms": round(seconds * 1e3, 3), f"{key}tflops": round(tflops, 2),
                    f"{key}of_matmul_peak": round(tflops / peak, 3), f"{key}flops": flops}
            if dmuon_step:
                row[f"{key}step_ms"] = round(dmuon_step_seconds(shape, device, ns_dtype, algorithm, repeats) * 1e3, 3)
        first = algorithms[0]
        for algorithm in algorithms[1:]:
            row[f"{algorithm}_speedup"] = round(row[f"{first}_ms"] / row[f"{algorithm}_ms"], 3)
            row[f"{algorithm}_flops_ratio"] = round(row[f"{first}_flops"] / row[f"{algorithm}_flops"], 3)
            if dmuon_step:
                row[f"{algorithm}_step_speedup"] = round(row[f"{first}_step_ms"] / row[f"{algorithm}_step_ms"], 3)
        rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} thread(s))"
    return {"device": name, "ns_dtype": str(dtype).removeprefix("torch."), "algorithms": list(algorithms),
            "matmul_bf16_tflops": round(peak, 1), "rows": rows}


def format_comparison(result: dict) -> str:
    """The table of several algorithms: ms each, and each one's speedup over the first."""
    first, *others = result["algorithms"]
    header = f"{'shape':>12} " + " ".join(f"{a + ' ms':>12}" for a in result["algorithms"])
    header += "".join(f" {a + ' speedup':>14} {'flops ratio':>11}" for a in others)
    step = any(f"{first}_step_ms" in row for row in result["rows"])
    if step:
        header += "".join(f" {a + ' step x':>13}" for a in others)
    lines = [header]
    for row in result["rows"]:
        line = f"{row['shape']:>12} " + " ".join(f"{row[a + '_ms']:>12.1f}" for a in result["algorithms"])
        line += "".join(f" {row[a + '_speedup']:>13.2f}x {row[a + '_flops_ratio']:>11.2f}" for a in others)
        if step:
            line += "".join(f" {row[a + '_step_speedup']:>12.2f}x" for a in others)
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ns_throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        help=f"ROWSxCOLS, or a set name from {sorted(SHAPE_SETS)} (default: llama3's)")
    parser.add_argument("--ns-dtype", choices=NS_DTYPE_CHOICES, default=DEFAULT_NS_DTYPE,
                        help="DMuon's ns_dtype (default %(default)s)")
    parser.add_argument("--algorithms", nargs="+", choices=NS_ALGORITHMS, default=[STANDARD],
                        help="ns_algorithm(s) to time; speedups are over the first (default %(default)s)")
    parser.add_argument("--dmuon-step", action="store_true", help="also time a DMuon step per shape and algorithm")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-matmul", type=int, default=PEAK_MATMUL, help="size of the peak-rate matmul")
    parser.add_argument("--peak-tflops", type=float, default=None, help="a datasheet bf16 peak, for its fraction")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [shape for name in args.shapes for shape in SHAPE_SETS.get(name, (name,))]
    shapes = [tuple(int(x) for x in s.split("x")) for s in names]
    result = measure(torch.device(args.device), shapes, args.repeats, args.peak_matmul, args.ns_dtype,
                     tuple(args.algorithms), args.dmuon_step)
    if args.peak_tflops:
        for row in result["rows"]:
            row["of_datasheet_peak"] = round(row["tflops"] / args.peak_tflops, 3)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['device']}: Newton-Schulz in {result['ns_dtype']}, one bf16 matmul of {args.peak_matmul}^3 "
          f"runs at {result['matmul_bf16_tflops']} TFLOP/s")
    if len(args.algorithms) > 1:
        print(format_comparison(result))
        return
    print(f"{'shape':>12} {'ms':>9} {'TFLOP/s':>8} {'of matmul':>10}")
    for row in result["rows"]:
        print(f"{row['shape']:>12} {row['ms']:>9.3f} {row['tflops']:>8.2f} {row['of_matmul_peak']:>10.1%}")


if __name__ == "__main__":
    main()
