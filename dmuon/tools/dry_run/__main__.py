"""``python -m dmuon.tools.dry_run``: DMuon's CUDA step at real scale, without a GPU.

Examples::

    python -m dmuon.tools.dry_run --model llama3-8b --world-size 64 --layout fsdp
    python -m dmuon.tools.dry_run --model llama3-70b --world-size 256 --layout hsdp:4x64 --json
    python -m dmuon.tools.dry_run --model moe-16b --world-size 32 --layout ep --ranks all --normuon
    python -m dmuon.tools.dry_run --model llama3-8b --world-size 64 --layout fsdp --cpu-offload

Each impersonated rank runs in a process of its own (a fresh fake process group and
fake CUDA device), builds the preset's parameters as fake CUDA tensors, lays them out
with FSDP2 / DTensor, and takes two real ``DMuon`` steps; the second is recorded
(``dmuon.tools.dry_run.recorder``). Exits 1 if any rank read a device value on the host, mixed
CPU and CUDA tensors, sent other bytes than the plan says, held more memory than the
bound, or ran a collective on CPU tensors; 2 on bad input (checked first, on any torch
build) or without a CUDA build of torch, which it needs (no GPU). What it proves and
what it cannot: docs/dry_run.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from dmuon.tools.dry_run.fake_cuda import DryRunError, check_cuda_build
from dmuon.tools.dry_run.layouts import OFFLOAD_LAYOUTS, parse_layout
from dmuon.tools.dry_run.models import PRESETS
from dmuon.tools.dry_run.run import PARAM_DTYPES, DryRunConfig, RankReport, run_rank, sample_ranks

MiB = 1 << 20
# ``--adamw-state-dtype``: "param" is ``DMuon(adamw_state_dtype=None)``, the parameters' dtype.
ADAMW_STATE_DTYPES = ("param", "bfloat16", "int8")
# Parallel rank processes by default: each is one thread (fake tensors do no math).
DEFAULT_JOBS = min(2, os.cpu_count() or 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dmuon.tools.dry_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"preset: {', '.join(PRESETS)}")
    parser.add_argument("--world-size", type=int, required=True, help="P ranks")
    parser.add_argument("--layout", default="fsdp", help="fsdp, hsdp[:RxS], fsdp_tp[:T], tp, ep (default fsdp)")
    parser.add_argument("--ranks", default=None,
                        help="ranks to impersonate: 'all', or a comma list (default: first, second, middle, last)")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="rank processes at once (default %(default)s)")
    parser.add_argument("--normuon", action="store_true", help="DMuon(normuon=True)")
    parser.add_argument("--cautious-weight-decay", action="store_true", help="DMuon(cautious_weight_decay=True)")
    parser.add_argument("--skip-nonfinite", action="store_true", help="DMuon(skip_nonfinite=True)")
    parser.add_argument("--momentum-dtype", default=None, choices=("bfloat16", "int8"),
                        help="DMuon(momentum_dtype=...) (default: the parameters' dtype)")
    parser.add_argument("--adamw-state-dtype", default="param", choices=ADAMW_STATE_DTYPES,
                        help="DMuon(adamw_state_dtype=...): the AdamW part's moments of parameters of 2+ dims "
                             "(default %(default)s: the parameters' dtype)")
    parser.add_argument("--capturable", action="store_true",
                        help="DMuon(capturable=True): steps 2-4 must launch the same host values (same scalars)")
    parser.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                        help="DMuon(qk_clip_threshold=TAU), every attention registered and reporting logits")
    parser.add_argument("--max-batch-numel", type=int, default=None, help="DMuon(max_batch_numel=...)")
    parser.add_argument("--nccl-alone", action="store_true",
                        help="a default group that takes no CPU tensors, as NCCL alone (TorchTitan's GPU default)")
    parser.add_argument("--param-dtype", default="float32", choices=PARAM_DTYPES,
                        help="the parameters' dtype (default %(default)s, as TorchTitan keeps them)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="FSDP2's CPUOffloadPolicy (parameters, grads and state on the host): "
                             f"{', '.join(OFFLOAD_LAYOUTS)}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace) -> tuple[DryRunConfig, list[int]]:
    if args.model not in PRESETS:
        raise DryRunError(f"unknown model {args.model!r}; choose from {', '.join(PRESETS)}")
    layout = parse_layout(args.layout, args.world_size)
    if layout.name == "ep" and not PRESETS[args.model].experts:
        moe = [name for name, preset in PRESETS.items() if preset.experts]
        raise DryRunError(f"--layout ep splits experts among ranks, and {args.model} has none; use a MoE preset "
                          f"({', '.join(moe)})")
    if args.cpu_offload and layout.name not in OFFLOAD_LAYOUTS:
        raise DryRunError(f"--cpu-offload is FSDP2's offload policy; the layout {layout.name} does not shard every "
                          f"Muon matrix with FSDP2: use {', '.join(OFFLOAD_LAYOUTS)}")
    options = {key: value for key, value in (
        ("normuon", args.normuon or None), ("cautious_weight_decay", args.cautious_weight_decay or None),
        ("skip_nonfinite", args.skip_nonfinite or None), ("capturable", args.capturable or None),
        ("qk_clip_threshold", args.qk_clip), ("max_batch_numel", args.max_batch_numel),
        ("momentum_dtype", args.momentum_dtype),
        ("adamw_state_dtype", None if args.adamw_state_dtype == "param" else args.adamw_state_dtype))
        if value is not None}
    return (DryRunConfig(args.model, PRESETS[args.model], layout, args.world_size, options, args.nccl_alone,
                         args.param_dtype, args.cpu_offload), _ranks(args))


def _ranks(args: argparse.Namespace) -> list[int]:
    if args.ranks is None:
        return sample_ranks(args.world_size)
    if args.ranks == "all":
        return list(range(args.world_size))
    try:
        ranks = sorted({int(r) for r in args.ranks.split(",")})
    except ValueError:
        raise DryRunError(f"--ranks {args.ranks!r}: write 'all' or ranks like 0,5,63") from None
    if ranks[0] < 0 or ranks[-1] >= args.world_size:
        raise DryRunError(f"--ranks {args.ranks}: ranks must be in 0..{args.world_size - 1}")
    return ranks


def run_ranks(config: DryRunConfig, ranks: list[int], jobs: int) -> list[RankReport]:
    """Each rank in a fresh process (a process is one rank of one fake world), forked from a
    server that imported torch and dmuon once (``forkserver``, where the platform has it):
    a spawned rank imported them again, 2.7 s of a debug model's 6.5 s on the 2-core VM."""
    return run_configs([(config, rank) for rank in ranks], jobs)


def run_configs(runs: list[tuple[DryRunConfig, int]], jobs: int) -> list[RankReport]:
    """:func:`run_ranks` of several configurations at once: each (config, rank) in a fresh
    process, ``jobs`` at a time, the reports in order."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([run_rank.__module__])  # read when the server starts: once a process
    else:
        context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=context, max_tasks_per_child=1) as pool:
        return list(pool.map(run_rank, *zip(*runs))) if runs else []


def summary(config: DryRunConfig, reports: list[RankReport]) -> dict:
    return {
        "model": config.model,
        "layout": str(config.layout),
        "world_size": config.world_size,
        "options": config.options,
        "cpu_offload": config.cpu_offload,
        "ok": not any(r.problems() for r in reports),
        "problems": {r.rank: r.problems() for r in reports if r.problems()},
        "ranks": [r.as_dict() for r in reports],
    }


def format_table(config: DryRunConfig, reports: list[RankReport]) -> str:
    head = (f"{config.model}, {config.layout}, P = {config.world_size}"
            + (f", {config.options}" if config.options else "") + (", CPU offload" if config.cpu_offload else ""))
    lines = [head, f"{'rank':>5} {'syncs':>5} {'sent MiB':>9} {'plan MiB':>9} {'ops':>6} {'state MiB':>10} "
                   f"{'peak MiB':>9} {'bound MiB':>10} {'collectives':<40} {'s':>5}"]
    for r in reports:
        collectives = ", ".join(f"{c['count']}x {c['op'].split('.')[1]} {c['dtype']}@{c['device']}"
                                for c in r.collectives)
        lines.append(f"{r.rank:>5} {r.host_syncs_per_step:>5} {r.bytes_sent_per_rank / MiB:>9.2f} "
                     f"{r.plan_bytes_sent_per_rank / MiB:>9.2f} {r.device_ops_per_step:>6} "
                     f"{r.state_bytes / MiB:>10.1f} {r.peak_step_bytes / MiB:>9.1f} {r.peak_bound_bytes / MiB:>10.1f} "
                     f"{collectives:<40} {r.seconds:>5.1f}")
    lines.append(f"{'rank':>5} {'host collectives':>16} {'groups made':>11} {'plan heap MiB':>13} {'same program':>12} "
                 f"{'same scalars':>12} {'Muon state B/elem':>17} {'AdamW state B/elem':>18} "
                 f"{'state B/param':>13} {'AdamW B/param':>13}")
    for r in reports:
        lines.append(f"{r.rank:>5} {r.host_collectives_per_step:>16} {r.process_groups_made:>11} "
                     f"{r.plan_host_bytes / MiB:>13.2f} {str(r.same_program):>12} {str(r.same_scalars):>12} "
                     f"{r.muon_state_bytes_per_element:>17.3f} {r.adamw_state_bytes_per_element:>18.3f} "
                     f"{r.state_bytes_per_param:>13.3f} {r.adamw_state_bytes_per_param:>13.3f}")
    if reports:
        r = reports[0]
        lines.append(f"the model's optimizer state (global, from the state tensors' global shapes): "
                     f"{r.model_state_bytes / MiB:.1f} MiB for {r.model_params:,} parameters, "
                     f"{r.state_bytes_per_param:.3f} bytes a parameter, of which AdamW's "
                     f"{r.adamw_state_bytes_per_param:.3f} ({r.model_adamw_params:,} AdamW parameters, "
                     f"{r.adamw_state_bytes_per_element:.3f} bytes each)")
    if changed := next((r for r in reports if r.scalar_changes), None):
        lines.append(f"rank {changed.rank}: the program changes with the learning rate and weight decay (a CUDA "
                     f"graph would replay step 2's values), e.g. {changed.scalar_changes[0]}")
    for r in reports if config.options.get("capturable") else []:
        lines.append(f"rank {r.rank}: a CUDA graph of the step keeps at least {r.graph_pool_bytes / MiB:.1f} MiB "
                     "reserved in its memory pool while it lives (the step's peak)")
    if off_route := next((r for r in reports if r.per_tensor_list_ops), None):
        ops = ", ".join(f"{count}x {op.split('.', 1)[1]}" for op, count in sorted(off_route.per_tensor_list_ops.items()))
        lines.append(f"rank {off_route.rank}: list ops off torch's multi-tensor route (one kernel per tensor): {ops}")
    for r in reports if config.cpu_offload else []:
        lines.append(f"rank {r.rank:>4} offload waits per step: {r.offload_waits} (documented: "
                     f"{r.documented_offload_waits})")
    for r in reports:
        for problem in r.problems():
            lines.append(f"rank {r.rank}: {problem}")
    ok = "ok: no host sync" + (" but the documented offload waits" if config.cpu_offload else "")
    lines.append(f"{ok}, bytes as planned, memory within the bound" if not any(r.problems() for r in reports)
                 else "FAILED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config, ranks = make_config(args)  # bad input is told on any torch build
        check_cuda_build()
    except DryRunError as error:
        print(f"dmuon.tools.dry_run: {error}", file=sys.stderr)
        return 2
    reports = run_ranks(config, ranks, args.jobs)
    print(json.dumps(summary(config, reports), indent=1) if args.json else format_table(config, reports))
    return 0 if not any(r.problems() for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
