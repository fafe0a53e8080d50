"""What QK-clip's logit measurement costs next to the attention it watches.

Run::

    python -m benchmarks.max_logits [--device cpu|cuda] [--batch 2 --heads 16 --kv-heads 16 --seq 256 --head-dim 16]

Times, on one attention's ``q``/``k``/``v`` of the given shape (median of repeats after
warm-up): SDPA's causal forward, SDPA's forward + backward (what a training step runs
per attention), and ``dmuon.attention.qk_clip.head_max_logits`` (what ``MaxLogitTracker.observe``
adds). Its scratch bound (``[batch, heads, chunk, keys]`` logits of one query chunk) is
printed from the formula; on CUDA the measured peak of extra memory is printed too.
The defaults are one attention of the CPU demo (TorchTitan's llama3 debug model:
16 heads of 16, 256 tokens, 2 sequences per rank).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dmuon.tools import DEFAULT_LOGIT_SCRATCH_BYTES, head_max_logits


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    q = torch.randn(args.batch, args.heads, args.seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(args.batch, args.kv_heads, args.seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    gqa = args.heads != args.kv_heads

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def forward_backward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).sum().backward()

    def measure():
        head_max_logits(q.detach(), k.detach())

    sdpa_f = _median_seconds(forward, device, args.repeats)
    sdpa_fb = _median_seconds(forward_backward, device, args.repeats)
    logits = _median_seconds(measure, device, args.repeats)
    scratch = min(DEFAULT_LOGIT_SCRATCH_BYTES, args.batch * args.heads * args.seq * args.seq * q.element_size())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)"
    print(f"device: {name}; torch {torch.__version__}; q {tuple(q.shape)} k {tuple(k.shape)} {args.dtype}")
    print(f"SDPA forward            {sdpa_f * 1e3:9.3f} ms")
    print(f"SDPA forward + backward {sdpa_fb * 1e3:9.3f} ms")
    print(f"head_max_logits         {logits * 1e3:9.3f} ms  ({logits / sdpa_fb:.2f}x the forward + backward)")
    print(f"scratch bound           {scratch / 2**20:9.3f} MiB (one chunk of logits; 64 MiB cap)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        measure()
        print(f"measured extra peak     {(torch.cuda.max_memory_allocated(device) - base) / 2**20:9.3f} MiB")


if __name__ == "__main__":
    main()
