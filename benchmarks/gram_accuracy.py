"""How far Gram and standard Newton-Schulz land from the exact polar factor, per dtype.

    python -m benchmarks.gram_accuracy                     # the table in docs/optimizer.md
    python -m benchmarks.gram_accuracy --coefficients polar_express --json

For each shape (aspect 1.5 to 8, wide and tall) and kind of input, the bf16 update
``G`` is orthogonalized by ``dmuon.numerics.newton_schulz.orthogonalize`` in several ways, and
each result ``O`` (bf16, as Muon applies it) is compared with the exact polar factor
``U V^T`` of ``G`` (SVD in float64): ``||O - U V^T||_F / ||U V^T||_F``. Five iterations
do not converge on small singular values, so even the float64 iteration is some way off;
the figure that matters is each column beside the float64 one. Inputs:

- ``gaussian``: i.i.d. normal (well conditioned);
- ``lowrank``: rank 8 plus 1e-3 noise (condition number ~1e3, like a gradient of a
  nearly saturated layer);
- ``momentum``: an EMA (beta 0.95) of 20 gradients with a power-law spectrum
  (``s_k ~ k^-1.5``) sharing their leading directions, plus noise.
"""

from __future__ import annotations

import argparse
import json

import torch

from dmuon import orthogonalize
from dmuon.tools import GRAM, STANDARD

DEFAULT_SHAPES = ("256x384", "384x256", "256x896", "896x256", "256x1024", "1024x256", "128x1024", "1024x128")
INPUTS = ("gaussian", "lowrank", "momentum")
# column -> (algorithm, standard dtype, Gram dtype, restarts)
VARIANTS: dict[str, tuple[str, torch.dtype, torch.dtype | None, tuple[int, ...]]] = {
    "std_fp64": (STANDARD, torch.float64, None, ()),
    "std_bf16": (STANDARD, torch.bfloat16, None, ()),
    "std_fp32": (STANDARD, torch.float32, None, ()),
    "gram_fp16": (GRAM, torch.bfloat16, torch.float16, (2,)),
    "gram_bf16": (GRAM, torch.bfloat16, torch.bfloat16, (2,)),
    "gram_fp32": (GRAM, torch.float32, torch.float32, (2,)),
    "gram_fp16_norestart": (GRAM, torch.bfloat16, torch.float16, ()),
    "gram_bf16_norestart": (GRAM, torch.bfloat16, torch.bfloat16, ()),
}


def make_input(kind: str, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """A bf16 update of ``shape`` of the given kind (see the module docstring)."""
    rows, cols = shape

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, dtype=torch.float64)

    if kind == "gaussian":
        full = randn(rows, cols)
    elif kind == "lowrank":
        full = randn(rows, 8) @ randn(8, cols) / 8 + 1e-3 * randn(rows, cols)
    else:
        k = min(shape)
        left, _ = torch.linalg.qr(randn(rows, k))
        right, _ = torch.linalg.qr(randn(cols, k))
        spectrum = torch.arange(1, k + 1, dtype=torch.float64) ** -1.5
        full = torch.zeros(rows, cols, dtype=torch.float64)
        for _ in range(20):
            grad = (left * spectrum * (1 + 0.3 * randn(k))) @ right.T + 0.01 * randn(rows, cols) / k**0.5
            full.lerp_(grad, 0.05)
    return full.to(torch.bfloat16)


def polar_factor(update: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(update.double(), full_matrices=False)
    return u @ vh


def distances(update: torch.Tensor, coefficients: str, steps: int) -> dict[str, float]:
    exact = polar_factor(update)
    result = {}
    for name, (algorithm, dtype, gram_dtype, restarts) in VARIANTS.items():
        ortho = orthogonalize(update, coefficients, steps, dtype=dtype, algorithm=algorithm, restarts=restarts,
                              gram_dtype_override=gram_dtype)
        result[name] = ((ortho.double() - exact).norm() / exact.norm()).item()
    return result


def measure(shapes: list[tuple[int, int]], coefficients: str, steps: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for shape in shapes:
        for kind in INPUTS:
            update = make_input(kind, shape, generator)
            rows.append({"shape": f"{shape[0]}x{shape[1]}", "input": kind,
                         **{k: round(v, 4) for k, v in distances(update, coefficients, steps).items()}})
    return rows


def format_table(rows: list[dict]) -> str:
    columns = list(VARIANTS)
    lines = [f"{'shape':>9} {'input':>9} " + " ".join(f"{c.replace('_norestart', '_0r'):>10}" for c in columns)]
    for row in rows:
        lines.append(f"{row['shape']:>9} {row['input']:>9} " + " ".join(f"{row[c]:>10.4f}" for c in columns))
    worst = {c: max(row[c] - row["std_fp64"] for row in rows) for c in columns}
    lines.append(f"{'worst excess over std_fp64':>19} " + " ".join(f"{worst[c]:>10.4f}" for c in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gram_accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="ROWSxCOLS")
    parser.add_argument("--coefficients", default="keller", help="ns_coefficients name (default %(default)s)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    rows = measure(shapes, args.coefficients, args.steps, args.seed)
    if args.json:
        print(json.dumps({"coefficients": args.coefficients, "steps": args.steps, "rows": rows}))
        return
    print(f"relative Frobenius distance to the exact polar factor; {args.coefficients}, {args.steps} steps; "
          "gram_*_0r: no restart")
    print(format_table(rows))


if __name__ == "__main__":
    main()
