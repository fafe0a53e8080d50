"""The AdamW part's step time by ``adamw_state_dtype`` (issue 69): what keeping the moments in
bf16 or int8 costs a step, against fp32 moments, on the parameters the AdamW part steps in an
LLM (an embedding and an output head, ``vocab x dim``, and the norms).

    python -m benchmarks.adamw_state_time [--vocab 32768] [--dim 1024] [--steps 20] [--threads 2]

One process, plain fp32 tensors (each rank's local shard steps alike: the AdamW part runs no
collective), ``DMuon`` with only AdamW groups, seeded grads; for each implementation torch
offers on the device (the for-loop, ``foreach``, ``fused``) and each state dtype, the median
wall time of ``--steps`` steps after two warm-up steps, and its ratio to fp32 moments' time
with the same implementation. Time it when nothing else runs on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dmuon import DMuon

FORMS = (None, "bfloat16", "int8")
IMPLEMENTATIONS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def median_step_seconds(vocab: int, dim: int, steps: int, state_dtype: str | None, flags: dict) -> float:
    generator = torch.Generator().manual_seed(0)
    shapes = [(vocab, dim), (vocab, dim)] + [(dim,)] * 8
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    optimizer = DMuon([{"params": params, "use_muon": False}], lr=1e-3, weight_decay=0.1,
                      adamw_state_dtype=state_dtype, **flags)
    for param, grad in zip(params, grads):
        param.grad = grad
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    elements = 2 * args.vocab * args.dim + 8 * args.dim
    print(f"AdamW part: {elements / 1e6:.1f}M fp32 elements (2 x {args.vocab} x {args.dim} and 8 norms), "
          f"{args.threads} threads, torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; median of {args.steps} steps")
    print("| implementation | adamw_state_dtype | step (ms) | against fp32 moments |")
    print("| --- | --- | ---: | ---: |")
    for name, flags in IMPLEMENTATIONS.items():
        base = None
        for form in FORMS:
            seconds = median_step_seconds(args.vocab, args.dim, args.steps, form, flags)
            base = base or seconds
            print(f"| {name} | {form} | {seconds * 1e3:.1f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
