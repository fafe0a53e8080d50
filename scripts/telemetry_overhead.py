"""DMuon step time with telemetry off and on, in one process, one thread.

    PYTHONPATH=. python scripts/telemetry_overhead.py

The 42 Muon matrices of TorchTitan's llama3 debug model (6 layers of wq, wk, wv, wo
256 x 256 and w1, w2, w3 with hidden size 768) plus a 2048 x 256 AdamW embedding.
Steps of the two optimizers alternate, so both see the same machine load; prints the
median of 10 steps after 2 warm-up steps (reading ``telemetry()`` each step, as
TorchTitan does on each logged step).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from dmuon import DMuon

SHAPES = [(256, 256)] * 4 * 6 + [(768, 256), (256, 768), (768, 256)] * 6
WARMUP, STEPS = 2, 10


def build(telemetry: bool) -> tuple[list[nn.Parameter], DMuon]:
    torch.manual_seed(0)
    matrices = [nn.Parameter(torch.randn(shape) * 0.02) for shape in SHAPES]
    embedding = nn.Parameter(torch.randn(2048, 256) * 0.02)
    groups = [{"params": matrices, "use_muon": True}, {"params": [embedding], "use_muon": False}]
    return matrices + [embedding], DMuon(groups, lr=0.02, weight_decay=0.1, telemetry=telemetry)


def main() -> None:
    torch.set_num_threads(1)
    runs = {telemetry: build(telemetry) for telemetry in (False, True)}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(WARMUP + STEPS):
        for telemetry, (params, optimizer) in runs.items():
            for param in params:
                param.grad = torch.randn_like(param)
            start = time.perf_counter()
            optimizer.step()
            optimizer.telemetry()
            seconds[telemetry].append(time.perf_counter() - start)
    for telemetry, values in seconds.items():
        print(f"telemetry={telemetry}: median step {statistics.median(values[WARMUP:]) * 1e3:.1f} ms over {STEPS} steps")


if __name__ == "__main__":
    main()
