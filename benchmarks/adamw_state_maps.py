"""Which map keeps AdamW's second moment in int8 (issue 69): measured, not guessed.

``exp_avg_sq`` is non-negative and spans many orders of magnitude inside one 128-element block
(an embedding row mixes features of every size; a rare token's row decays for thousands of steps
between its grads). A linear int8 map of ``v`` rounds everything under ``max(v) / 254`` to 0, and
where ``v`` is 0 but the first moment is not, AdamW's step ``m / (sqrt(v) + eps)`` is ``m / eps``:
a blow-up. Candidates, each with the first moment in linear int8, as DMuon keeps it:

- ``linear``: int8 of ``v`` itself;
- ``root``: int8 of ``sqrt(v)`` (what DMuon keeps): the step reads ``sqrt(v)``'s resolution, and
  the range one block holds squares (a 1/127 of the block's largest root is 1/16129 of its v);
- ``bf16``: both moments in bf16 (DMuon's ``"bfloat16"``), for scale.

The workload is an embedding's AdamW: Zipf-distributed token rows (s = 1.1 over the vocabulary),
each step's grads on the rows of a batch of tokens, row norms spread log-uniformly over two
decades, AdamW's betas (0.9, 0.95). Every map runs beside an fp32 AdamW on the same grads and is
compared with it after each step, on the elements that moved: the relative error of the step
``|u - u_fp32| / |u_fp32|`` (median and 99th percentile), and the share of elements whose step is
over twice fp32's.

    python -m benchmarks.adamw_state_maps [--steps 300] [--vocab 8192] [--dim 256] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from dmuon.tools import dequantize_int8, quantize_int8


def _kept(x: torch.Tensor, form: str) -> torch.Tensor:
    """``x`` as the next step reads it back from ``form``."""
    if form == "bf16":
        return x.bfloat16().float()
    if form == "root":
        return dequantize_int8(*quantize_int8(x.sqrt()), torch.float32).square()
    return dequantize_int8(*quantize_int8(x), torch.float32)


def measure(steps: int, vocab: int, dim: int, seed: int, tokens: int = 4096) -> dict[str, dict[str, float]]:
    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    row_scale = 10 ** (-2 * torch.rand(vocab, 1, generator=gen))
    beta1, beta2, eps = 0.9, 0.95, 1e-8
    forms = ("linear", "root", "bf16")
    m = {f: torch.zeros(vocab, dim) for f in ("fp32", *forms)}
    v = {f: torch.zeros(vocab, dim) for f in ("fp32", *forms)}
    errors = {f: [] for f in forms}
    far = {f: [0, 0] for f in forms}
    for step in range(1, steps + 1):
        rows = torch.multinomial(zipf, tokens, replacement=True, generator=gen)
        grad = torch.zeros(vocab, dim).index_add_(0, rows, torch.randn(tokens, dim, generator=gen)) * row_scale
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        updates = {}
        for f in m:
            m[f].lerp_(grad, 1 - beta1)
            v[f].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            updates[f] = (m[f] / bias1) / ((v[f] / bias2).sqrt() + eps)
            if f != "fp32":
                m[f] = _kept(m[f], "bf16" if f == "bf16" else "linear")
                v[f] = _kept(v[f], f)
        moved = updates["fp32"] != 0
        for f in forms:
            rel = ((updates[f] - updates["fp32"]).abs() / updates["fp32"].abs())[moved]
            errors[f].append(rel)
            far[f][0] += int((rel > 1).sum())
            far[f][1] += rel.numel()
    out = {}
    for f in forms:
        rel = torch.cat(errors[f])
        sample = rel[torch.randperm(rel.numel(), generator=gen)[: 1 << 20]]
        out[f] = {"median": float(sample.median()), "p99": float(sample.quantile(0.99)),
                  "over_2x": far[f][0] / max(far[f][1], 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = measure(args.steps, args.vocab, args.dim, args.seed)
    print(f"AdamW step error against fp32 state, {args.steps} steps, embedding {args.vocab} x {args.dim}, "
          f"seed {args.seed}")
    print("| exp_avg_sq kept as | median relative error | 99th percentile | steps over 2x fp32's |")
    print("| --- | ---: | ---: | ---: |")
    names = {"linear": "int8 of v", "root": "int8 of sqrt(v)", "bf16": "bf16 (both moments)"}
    for form, figures in results.items():
        print(f"| {names[form]} | {figures['median']:.2e} | {figures['p99']:.2e} | {figures['over_2x']:.2e} |")


if __name__ == "__main__":
    main()
