"""The parts of ``scripts/gpu_check.sh`` that no existing benchmark or test does, one per
subcommand, each writing one JSON fragment (``{"status", "figures", "reason"}``) that
``benchmarks.gpu_check_summary`` gathers into ``summary.json``:

    python -m benchmarks.gpu_check one_rank --model llama3-8b --world-size 8 --out F.json
    python -m benchmarks.gpu_check compare --dim 4096 --layers 2 --out F.json
    python -m benchmarks.gpu_check captured --dim 4096 --layers 2 --out F.json
    python -m benchmarks.gpu_check two_ranks --out F.json

- ``one_rank`` (issue 41, 3e): rank 0 of a P-rank FSDP2 job in one process: PyTorch's fake
  process group (every collective returns at once, so the exchange costs nothing) and real
  tensors for this rank's shards on the device (``--device``), so Newton-Schulz and the
  elementwise work are real; its step time next to ``dmuon.tools.plan_report``'s prediction for
  the same model and P. The cost model is recalibrated from the ratio (``ns_mfu_implied``).
- ``compare`` (3f): one step of DMuon, torch.optim.Muon (+ AdamW for the rest) and fused
  AdamW on the same few llama3-wide layers, one device, and their ratios.
- ``captured`` (issue 42, item 7): a ``capturable`` DMuon eager and replayed from one CUDA
  graph (``dmuon.capture.cuda_graphs``) under a cosine schedule with a NaN grad at one step:
  bitwise equal, and the eager against the replayed step time.
- ``two_ranks`` (3h): P = 2 on one GPU over gloo (NCCL refuses two ranks on one GPU),
  every layout bitwise equal to P = 1; a failure is kept with its reason (a collective gloo
  does not carry for CUDA tensors).

Why a fragment per part: a part that hangs or dies (killed by its timeout) leaves the
others' figures, and the summary says which part wrote nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# Steps before timing (state, plan, kernels' first launch) and timed steps (their median).
WARMUP_STEPS = 2
TIMED_STEPS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step_ms(step, device: torch.device, warmup: int = WARMUP_STEPS, steps: int = TIMED_STEPS) -> float:
    """Median wall time of ``step()`` in ms, the device synchronized around each."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _random_grads(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3


# ---------------------------------------------------------------- one rank of a big job


def one_rank(model: str, world_size: int, device: torch.device, steps: int) -> dict:
    """Rank 0 of ``world_size`` under FSDP2 on the fake process group, real shards on ``device``."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon import DMuon
    from dmuon.tools import build, DRY_RUN_PRESETS as PRESETS, fake_store, lay_out, parse_layout

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        with torch.device("meta"):
            net = build(PRESETS[model])
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
        lay_out(net, parse_layout("fsdp", world_size), mesh)
        net.to_empty(device=device)
        with torch.no_grad():
            for param in net.parameters():
                param.normal_(0, 0.02)
        _random_grads(net)
        optimizer = DMuon(net.named_parameters(), lr=0.01, weight_decay=0.1)
        measured = median_step_ms(optimizer.step, device, warmup=1, steps=steps)
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in net.parameters())
    finally:
        dist.destroy_process_group()
    predicted = plan_prediction(model, world_size)
    figures = {"model": model, "world_size": world_size, "rank": 0, "local_params": local,
               "measured_step_ms": round(measured, 3), "predicted": predicted}
    if predicted.get("ns_ms"):
        # The prediction's Newton-Schulz term scales as 1 / ns_mfu: the mfu these figures imply.
        figures["predicted_over_measured"] = round(predicted["optimizer_ms"] / measured, 4)
    return figures


def plan_prediction(model: str, world_size: int) -> dict:
    """``python -m dmuon.tools.plan_report --json``'s prediction for ``model`` at ``world_size``
    (empty for a preset plan_report does not know, e.g. the rehearsal's ``debug``)."""
    from dmuon.tools import LLAMA3_SHAPES as PRESETS

    if model not in PRESETS:
        return {}
    out = subprocess.run([sys.executable, "-m", "dmuon.tools.plan_report", "--model", model, "--world-size",
                          str(world_size), "--json"], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)["predicted"]


# ---------------------------------------------------------------- DMuon vs torch's optimizers


def compare(dim: int, layers: int, device: torch.device, steps: int) -> dict:
    """Step times of DMuon, torch.optim.Muon + AdamW and fused AdamW on one model."""
    from dmuon import DMuon
    from dmuon.tools import build, Preset

    preset = Preset(dim=dim, ffn=int(dim * 3.5), n_heads=max(1, dim // 128), n_kv_heads=max(1, dim // 512),
                    layers=layers, vocab=4096, head_dim=128 if dim >= 1024 else 16)
    figures = {"dim": dim, "layers": layers}
    makers = {
        "dmuon": lambda net: [DMuon(net.named_parameters(), lr=0.02, weight_decay=0.1, fused=True)],
        "torch_muon_adamw": lambda net: _torch_muon_adamw(net),
        "fused_adamw": lambda net: [torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1, fused=True)],
    }
    for name, make in makers.items():
        torch.manual_seed(0)
        with torch.device(device):
            net = build(preset)
        _random_grads(net)
        optimizers = make(net)
        figures[f"{name}_step_ms"] = round(median_step_ms(lambda: [o.step() for o in optimizers], device,
                                                          steps=steps), 3)
        figures["params"] = sum(p.numel() for p in net.parameters())
        del net, optimizers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name in ("torch_muon_adamw", "fused_adamw"):
        figures[f"dmuon_over_{name}"] = round(figures["dmuon_step_ms"] / figures[f"{name}_step_ms"], 3)
    return figures


def _torch_muon_adamw(net: nn.Module) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon for the hidden matrices, AdamW (fused) for embeddings, output and norms."""
    hidden = [p for n, p in net.named_parameters() if p.ndim == 2 and "embed" not in n and "output" not in n]
    rest = [p for n, p in net.named_parameters() if not (p.ndim == 2 and "embed" not in n and "output" not in n)]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)]


# ---------------------------------------------------------------- the captured step


def captured(dim: int, layers: int, device: torch.device, steps: int, total: int = 10) -> dict:
    """A ``capturable`` DMuon stepped eagerly and through ``dmuon.capture.cuda_graphs`` on the same
    model and grads under a cosine schedule (a NaN grad at one step, ``skip_nonfinite``):
    bitwise equal after ``total`` steps, the skipped step counted once by ``check()`` called
    twice every few steps, and the eager against the replayed step time (issues 42, 50)."""
    from dmuon import CapturedStep, DMuon
    from dmuon.tools import build, Preset

    if device.type != "cuda":
        raise RuntimeError("needs a CUDA GPU (CUDA graphs)")
    preset = Preset(dim=dim, ffn=int(dim * 3.5), n_heads=max(1, dim // 128), n_kv_heads=max(1, dim // 512),
                    layers=layers, vocab=4096, head_dim=128 if dim >= 1024 else 16)
    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        with torch.device(device):
            net = build(preset)
        for param in net.parameters():
            param.grad = torch.zeros_like(param)
        optimizer = DMuon(net.named_parameters(), lr=0.02, weight_decay=0.1, fused=True, capturable=True,
                          skip_nonfinite=True)
        twins.append((net, optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)))
    (eager_net, eager, eager_lr), (graph_net, graphed, graph_lr) = twins
    replay = CapturedStep(graphed)
    for step in range(total):
        generator = torch.Generator(device=device).manual_seed(step)
        for a, b in zip(eager_net.parameters(), graph_net.parameters()):
            grad = torch.randn(a.shape, device=device, generator=generator) * 1e-3
            if step == total // 2 and a.ndim == 2:
                grad[0, 0] = float("nan")
            a.grad.copy_(grad)
            b.grad.copy_(grad)
        eager.step()
        eager_lr.step()
        replay.step()
        graph_lr.step()
        if step % 4 == 3 or step == total - 1:  # as at a logging step: the replays since the last check,
            replay.check()  # the NaN's among them though not the last (issue 50, 3),
            replay.check()  # each counted once however often check() is called
    torch.cuda.synchronize(device)
    equal = all(torch.equal(a, b) for a, b in zip(eager_net.parameters(), graph_net.parameters()))
    if not equal or graphed.skipped_steps != eager.skipped_steps:
        raise AssertionError(f"replayed steps differ from eager ones (bitwise equal: {equal}, skipped: "
                             f"{graphed.skipped_steps} vs {eager.skipped_steps})")
    eager_ms = median_step_ms(eager.step, device, steps=steps)
    replay_ms = median_step_ms(replay.step, device, steps=steps)
    replay.release()
    return {"dim": dim, "layers": layers, "steps_bitwise_equal": total, "skipped_steps": graphed.skipped_steps,
            "eager_step_ms": round(eager_ms, 3), "replayed_step_ms": round(replay_ms, 3),
            "eager_over_replayed": round(eager_ms / replay_ms, 3)}


# ---------------------------------------------------------------- two ranks on one GPU


def two_ranks() -> dict:
    """P = 2 over gloo with CUDA tensors (``DMUON_SCENARIO_DEVICE=cuda``), every layout vs P = 1."""
    from tests import distributed_scenarios as scenarios
    from tests.multiprocess import run_on_ranks

    layouts = [name for name, _, _ in scenarios.LAYOUT_CASES]
    os.environ["DMUON_SCENARIO_DEVICE"] = "cuda"
    result = run_on_ranks(scenarios.layout_exactness, 2, layouts, 1 << 27, timeout=240, fresh=True)[0]
    equal = result["equal"]
    if equal != dict.fromkeys(layouts, True):
        raise AssertionError(f"layouts not bitwise equal to P = 1: {sorted(k for k, v in equal.items() if not v)}")
    return {"layouts": len(layouts), "all_bitwise_equal": True, "paths": sorted(set(result["paths"].values()))}


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("one_rank", "compare", "captured", "two_ranks"))
    parser.add_argument("--out", required=True, help="the JSON fragment to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="llama3-8b", help="one_rank: a dmuon.tools.dry_run preset")
    parser.add_argument("--world-size", type=int, nargs="+", default=[8], help="one_rank: P (several: one each)")
    parser.add_argument("--dim", type=int, default=4096, help="compare, captured: model width")
    parser.add_argument("--layers", type=int, default=2, help="compare, captured: blocks")
    parser.add_argument("--steps", type=int, default=TIMED_STEPS, help="timed steps")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    fragment: dict = {"status": "ok", "figures": {}, "reason": ""}
    try:
        if args.part == "one_rank":
            fragment["figures"] = {f"{args.model}_P{p}": one_rank(args.model, p, device, args.steps)
                                   for p in args.world_size}
        elif args.part == "compare":
            fragment["figures"] = compare(args.dim, args.layers, device, args.steps)
        elif args.part == "captured":
            fragment["figures"] = captured(args.dim, args.layers, device, args.steps)
        else:
            fragment["figures"] = two_ranks()
    except Exception as error:  # the fragment keeps the reason; the summary marks the part failed
        traceback.print_exc()
        fragment.update(status="failed", reason=f"{type(error).__name__}: {error}"[:500])
    print(json.dumps(fragment, indent=2))
    Path(args.out).write_text(json.dumps(fragment, indent=2))
    sys.exit(0 if fragment["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
