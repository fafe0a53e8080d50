"""Newton-Schulz throughput on one device, next to the device's own bf16 matmul rate.

    python -m benchmarks.ns_throughput --device cuda          # llama3 8B / 70B matrix shapes
    python -m benchmarks.ns_throughput --device cpu --shapes 256x1024 --repeats 2

For each shape: the time of ``dmuon.newton_schulz.orthogonalize`` (5 steps, bf16 on an
accelerator), its TFLOP/s by ``newton_schulz_flops``, and that as a fraction of the
TFLOP/s of one large bf16 matmul on the same device (the achievable peak, measured
here rather than taken from a datasheet). ``--peak-tflops`` adds the fraction of a
datasheet figure.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dmuon.newton_schulz import newton_schulz_flops, orthogonalize, resolve_ns_dtype

# llama3 8B's Muon matrices (wq/wo, wk/wv, w1/w3, w2) and 70B's MLP: rows x cols.
DEFAULT_SHAPES = ("4096x4096", "1024x4096", "14336x4096", "4096x14336", "28672x8192")
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


def measure(device: torch.device, shapes: list[tuple[int, int]], repeats: int, peak_size: int) -> dict:
    dtype = resolve_ns_dtype("auto", device.type)
    peak = matmul_tflops(device, peak_size, repeats)
    rows = []
    for shape in shapes:
        update = torch.randn(shape, device=device, dtype=torch.bfloat16)
        seconds = timed(lambda: orthogonalize(update, dtype=dtype), device, repeats)
        tflops = newton_schulz_flops(shape) / seconds / 1e12
        rows.append({"shape": f"{shape[0]}x{shape[1]}", "ms": round(seconds * 1e3, 3), "tflops": round(tflops, 2),
                     "of_matmul_peak": round(tflops / peak, 3)})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({torch.backends.cpu.get_cpu_capability()})"
    return {"device": name, "ns_dtype": str(dtype).removeprefix("torch."),
            "matmul_bf16_tflops": round(peak, 1), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ns_throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="ROWSxCOLS (default: llama3's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-matmul", type=int, default=PEAK_MATMUL, help="size of the peak-rate matmul")
    parser.add_argument("--peak-tflops", type=float, default=None, help="a datasheet bf16 peak, for its fraction")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    result = measure(torch.device(args.device), shapes, args.repeats, args.peak_matmul)
    if args.peak_tflops:
        for row in result["rows"]:
            row["of_datasheet_peak"] = round(row["tflops"] / args.peak_tflops, 3)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['device']}: Newton-Schulz in {result['ns_dtype']}, one bf16 matmul of {args.peak_matmul}^3 "
          f"runs at {result['matmul_bf16_tflops']} TFLOP/s")
    print(f"{'shape':>12} {'ms':>9} {'TFLOP/s':>8} {'of matmul':>10}")
    for row in result["rows"]:
        print(f"{row['shape']:>12} {row['ms']:>9.3f} {row['tflops']:>8.2f} {row['of_matmul_peak']:>10.1%}")


if __name__ == "__main__":
    main()
