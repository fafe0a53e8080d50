"""The Muon momentum's memory on real ranks, measured from live tensors (issue 60, item 3):
at rest (between steps, grads dropped: what sits beside the activations) and at the step's
peak, per local Muon element, for each ``momentum_dtype``.

    python -m benchmarks.momentum_memory [--world-size 2] [--dim 512] [--layers 2]
    python -m benchmarks.momentum_memory --shapes 65536x1,8192x8,1024x129   # each matrix alone

Each rank holds a llama-like stack of ``Shard(0)`` DTensors (FSDP2's layout: per layer
``wq``, ``wk``, ``wv``, ``wo`` of ``dim x dim`` and ``w1``, ``w3`` of ``8/3 dim x dim``, ``w2``
its transpose; fp32, as FSDP2 keeps them) and steps DMuon three times on seeded grads:

- ``at rest``: the bytes of the storages alive after the third step and ``zero_grad`` that
  did not exist before the first (``benchmarks.live_tensors.live_storages``: every tensor
  ``gc`` sees), and the optimizer state's among them;
- ``step peak``: the most bytes the third step held at once above what existed when it
  began (``benchmarks.live_tensors.PeakBytes``: every storage an op made, until freed).

With ``--shapes``, each matrix is measured alone the same way (one ``Shard(0)`` fp32 DTensor):
the state and the step's peak per local element by ``momentum_dtype``, how the int8 state's
cost follows the row width (docs/optimizer.md, "Momentum dtype").

With ``--vocab V``, the whole optimizer (issue 69): the stack gets an embedding and an output
head of ``V x dim`` and a norm per layer and one more in the AdamW part, and each combination of
``momentum_dtype`` and ``adamw_state_dtype`` that docs/optimizer.md tabulates is measured: the
state's bytes per local parameter of each part and of the whole model, and the third step's
peak (docs/optimizer.md, "The whole optimizer's memory").
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

ROWS = ("None", "bfloat16", "int8")


def shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    hidden = 8 * dim // 3 // 128 * 128
    return [shape for _ in range(layers) for shape in
            [(dim, dim)] * 4 + [(hidden, dim), (dim, hidden), (hidden, dim)]]


def measure(matrices: list[tuple[int, int]], momentum_dtype: str | None, adamw_shapes: list[tuple[int, ...]] = (),
            adamw_state_dtype: str | None = None) -> dict[str, float]:
    """On each rank (one thread each), ``matrices`` (and the AdamW part's ``adamw_shapes``) as
    ``Shard(0)`` DTensors stepped three times: bytes per local Muon element at rest (all, the
    state's) and at the third step's peak, and the rank's Muon elements; the state's bytes per
    local element of each part and of both (``state_per_param``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from benchmarks.live_tensors import PeakBytes, live_storages, state_storages, storage_key
    from dmuon import DMuon

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=generator) for shape in matrices]
    fulls += [torch.randn(shape, generator=generator) for shape in adamw_shapes]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in fulls]
    muon, adamw = params[: len(matrices)], params[len(matrices):]
    optimizer = DMuon([{"params": muon, "use_muon": True}] + ([{"params": adamw, "use_muon": False}] if adamw else []),
                      lr=0.02, momentum_dtype=momentum_dtype, adamw_state_dtype=adamw_state_dtype)
    gc.collect()
    before = live_storages()
    peak = PeakBytes()
    for step in range(3):
        for param, full in zip(params, fulls):
            param.grad = distribute_tensor(full * (step + 1) * 1e-3, mesh, [Shard(0)])
        if step == 2:
            with peak:
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    gc.collect()
    after = live_storages()
    new = {ptr: size for ptr, (size, _) in after.items() if ptr not in before}
    state = state_storages(optimizer)
    elements = sum(p.to_local().numel() for p in muon)
    figures = {"at_rest": sum(new.values()) / elements, "state": sum(s for p, s in new.items() if p in state) / elements,
               "peak": peak.bytes / elements, "elements": elements}
    if adamw:
        for name, part in (("muon", muon), ("adamw", adamw), ("param", params)):
            held = dict(key for p in part for t in optimizer.state[p].values()
                        if isinstance(t, torch.Tensor) and (key := storage_key(t)) is not None)
            figures[f"state_per_{name}"] = sum(held.values()) / max(1, sum(p.to_local().numel() for p in part))
        figures["peak_per_param"] = peak.bytes / sum(p.to_local().numel() for p in params)
    return figures


def main(argv: list[str] | None = None) -> None:
    from benchmarks.spawned_ranks import run_on_ranks

    parser = argparse.ArgumentParser(prog="python -m benchmarks.momentum_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shapes", help="measure each of these matrices alone (RxC, comma-separated) instead")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --shapes: measure each this many times, the least peak kept (a buffer gloo's "
                             "thread lets go of a moment late only adds to a peak)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--vocab", type=int, default=0,
                        help="the whole optimizer: an embedding and an output head of VOCAB x dim and the norms in the "
                             "AdamW part, every combination of momentum_dtype and adamw_state_dtype")
    args = parser.parse_args(argv)
    if args.vocab:
        return whole_optimizer(args.world_size, args.dim, args.layers, args.vocab, args.json)
    if args.shapes:
        return per_shape([tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")],
                         args.world_size, args.json, args.repeat)
    rows = {}
    for name in ROWS:
        ranks = run_on_ranks(measure, args.world_size, shapes(args.dim, args.layers), None if name == "None" else name,
                             timeout=600)
        rows[name] = {key: max(r[key] for r in ranks) for key in ranks[0]}
    print(f"momentum memory: {args.world_size} ranks, Shard(0), {args.layers} llama-like layers of dim {args.dim} "
          f"(fp32), torch {torch.__version__}; bytes per local Muon element, the largest rank's")
    print(f"{'momentum_dtype':>14} {'at rest':>8} {'state':>8} {'step peak':>10}")
    for name, row in rows.items():
        print(f"{name:>14} {row['at_rest']:8.3f} {row['state']:8.3f} {row['peak']:10.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)


# The combinations docs/optimizer.md tabulates: (momentum_dtype, adamw_state_dtype).
WHOLE_ROWS = ((None, None), ("int8", None), ("int8", "bfloat16"), ("int8", "int8"), ("bfloat16", "bfloat16"))


def whole_optimizer(world_size: int, dim: int, layers: int, vocab: int, json_path: str | None) -> None:
    """``--vocab``: the whole optimizer's state per local parameter, each part's, and the step's peak."""
    from benchmarks.spawned_ranks import run_on_ranks

    adamw_shapes = [(vocab, dim), (vocab, dim)] + [(dim,)] * (2 * layers + 1)
    muon = shapes(dim, layers)
    share = sum(v * d for v, d in adamw_shapes[:2]) + dim * (2 * layers + 1)
    share /= share + sum(r * c for r, c in muon)
    rows = {}
    for momentum_dtype, state_dtype in WHOLE_ROWS:
        ranks = run_on_ranks(measure, world_size, muon, momentum_dtype, adamw_shapes, state_dtype, timeout=600)
        rows[f"{momentum_dtype} {state_dtype}"] = {key: max(r[key] for r in ranks) for key in ranks[0]}
    print(f"whole optimizer memory: {world_size} ranks, Shard(0), {layers} llama-like layers of dim {dim} and an "
          f"embedding and output of {vocab} x {dim} (the AdamW part: {share:.1%} of the parameters; fp32), torch "
          f"{torch.__version__}; bytes per local parameter of each part, the largest rank's")
    print(f"{'momentum_dtype':>14} {'adamw_state':>11} {'Muon part':>9} {'AdamW part':>10} {'whole':>7} {'step peak':>9}")
    for (momentum_dtype, state_dtype), row in zip(WHOLE_ROWS, rows.values()):
        print(f"{str(momentum_dtype):>14} {str(state_dtype):>11} {row['state_per_muon']:9.3f} "
              f"{row['state_per_adamw']:10.3f} {row['state_per_param']:7.3f} {row['peak_per_param']:9.3f}")
    if json_path:
        with open(json_path, "w") as out:
            json.dump(rows, out, indent=2)


def per_shape(matrices: list[tuple[int, int]], world_size: int, json_path: str | None, repeat: int = 1) -> None:
    """``--shapes``: each matrix alone, its state and step peak per local element by ``momentum_dtype``
    (the least peak of ``repeat`` measures)."""
    from benchmarks.spawned_ranks import run_on_ranks

    rows = {}
    for shape in matrices:
        for name in ROWS:
            for _ in range(repeat):
                ranks = run_on_ranks(measure, world_size, [shape], None if name == "None" else name, timeout=600)
                row = {key: max(r[key] for r in ranks) for key in ranks[0]}
                held = rows.setdefault((f"{shape[0]}x{shape[1]}", name), row)
                held["peak"] = min(held["peak"], row["peak"])
    print(f"momentum memory per matrix: {world_size} ranks, Shard(0), one fp32 matrix alone, torch "
          f"{torch.__version__}; bytes per local element, the largest rank's (the peak: the least of {repeat})")
    print(f"{'shape':>10} " + " ".join(f"{'state ' + n:>14}" for n in ROWS) + " "
          + " ".join(f"{'peak ' + n:>13}" for n in ROWS))
    for shape in dict.fromkeys(key for key, _ in rows):
        print(f"{shape:>10} " + " ".join(f"{rows[shape, n]['state']:14.3f}" for n in ROWS) + " "
              + " ".join(f"{rows[shape, n]['peak']:13.2f}" for n in ROWS))
    if json_path:
        with open(json_path, "w") as out:
            json.dump({f"{shape} {name}": row for (shape, name), row in rows.items()}, out, indent=2)


if __name__ == "__main__":
    main()
