"""Real DMuon steps on CUDA under ``torch.cuda.set_sync_debug_mode("error")``: any
device-to-host sync in a step raises. The GPU twin of ``python -m dmuon.tools.dry_run``.

    python -m benchmarks.sync_free_step                                  # one GPU
    torchrun --standalone --nproc-per-node 8 -m benchmarks.sync_free_step   # FSDP2 over 8

The model is the dry run's ``debug`` preset widened to ``--dim``, laid out with
``fully_shard`` on every rank; two warm-up steps make the state and the plan (the first
step may sync once), then ``--steps`` steps run with sync debugging set to "error", for
the default options, cautious decay, NorMuon (alone and with cautious decay) and Gram
Newton-Schulz. (QK-clip needs the attention's max logits from a forward: not here.)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dmuon import DMuon
from dmuon.tools import build, lay_out, parse_layout, Preset

VARIANTS = {"default": {}, "cautious": {"cautious_weight_decay": True}, "normuon": {"normuon": True},
            "normuon+cautious": {"normuon": True, "cautious_weight_decay": True}, "gram": {"ns_algorithm": "gram"}}


def init() -> int:
    """NCCL over the torchrun ranks, or a one-rank group; returns the world size."""
    if "WORLD_SIZE" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_world_size()


def check(dim: int, steps: int, options: dict) -> None:
    world = dist.get_world_size()
    preset = Preset(dim=dim, ffn=dim * 3, n_heads=dim // 64, n_kv_heads=dim // 128, layers=4, vocab=4096,
                    head_dim=64)
    with torch.device("cuda"):
        model = build(preset)
    lay_out(model, parse_layout("fsdp", world), init_device_mesh("cuda", (world,), mesh_dim_names=("dp_shard",)))
    optimizer = DMuon(model.named_parameters(), lr=0.01, weight_decay=0.1, **options)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    for _ in range(2):
        optimizer.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sync_free_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.sync_free_step needs a CUDA GPU (torch.cuda.is_available() is False)")
    world = init()
    try:
        for name, options in VARIANTS.items():
            check(args.dim, args.steps, options)
            if dist.get_rank() == 0:
                print(f"sync-free: {args.steps} DMuon steps ({name}) on {world} x "
                      f"{torch.cuda.get_device_name()} with set_sync_debug_mode('error')", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
