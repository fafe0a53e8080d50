"""Worker functions for ``capturable=True`` on real ranks (tests/test_capturable_ranks.py).

Each runs the same parameters twice on this rank, with ``capturable`` off and on, under a
learning-rate schedule (``LambdaLR``: warm-up, then decay) and a weight-decay schedule that
change every step, with ``skip_nonfinite`` on and, optionally, a NaN in one grad on one
rank at one step; and returns whether every local bit (parameters, every state value, the
skipped-step count) agrees. Layouts: FSDP on a 1-D mesh of any size (uneven and empty
shards, experts, a TP-like ``Shard(1)``), and TorchTitan's 2 x 2 layouts (HSDP, FSDP + TP,
TP, EP, EP + FSDP) from tests/mesh_scenarios.py. Each DTensor is cut where DTensor says its
block lives (``benchmarks.layouts.as_dtensor``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from benchmarks.layouts import as_dtensor
from dmuon import DMuon
from tests.distributed_scenarios import LAYOUT_CASES, _device, device_type
from tests.mesh_scenarios import MESH_CASES

STEPS = 5
BAD_STEP = 2
# A weight decay per step (0.0 included: the capturable step multiplies by exactly 1 there;
# not at BAD_STEP, where a masked decay left unmasked would change the parameters: issue 52).
WEIGHT_DECAYS = (0.1, 0.05, 0.2, 0.0, 0.1)
# The parameter whose grad gets the NaN (its last row: in the last rank's block, not in the others').
POISONED = {"fsdp": "rows", "mesh_2x2": "hsdp.rows"}
VARIANTS = {
    "plain": {},
    "normuon": {"normuon": True},
    "cautious": {"cautious_weight_decay": True},
    "nesterov_off_gram": {"nesterov": False, "ns_algorithm": "gram"},
}


def lr_factor(step: int) -> float:
    """Warm-up over two steps, then a decay: a different learning rate at every step."""
    return (step + 1) / 2 if step < 2 else 0.7 ** (step - 1)


def set_weight_decay(optimizer: torch.optim.Optimizer, value: float) -> None:
    """A weight-decay schedule as a user writes it: in place where the group holds a tensor."""
    for group in optimizer.param_groups:
        if isinstance(group["weight_decay"], torch.Tensor):
            group["weight_decay"].fill_(value)
        else:
            group["weight_decay"] = value


def _layout(name: str) -> tuple[Any, dict[str, tuple[tuple[int, ...], tuple[Placement, ...]]]]:
    """The mesh and each parameter's (shape, placements); an AdamW vector beside the matrices."""
    world = dist.get_world_size()
    if name == "fsdp":
        mesh = init_device_mesh(device_type(), (world,))
        cases = {n: (shape, (Shard(dim),)) for n, shape, dim in LAYOUT_CASES}
        cases["norm_weight"] = ((7,), (Shard(0),))
        return mesh, cases
    mesh = init_device_mesh(device_type(), (2, 2))
    cases = {n: (shape, placements) for group in MESH_CASES.values() for n, shape, placements in group}
    cases["norm_weight"] = ((7,), (Replicate(), Shard(0)))
    return mesh, cases


def _full(seed: int, cases) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=generator).to(_device()) for n, (shape, _) in cases.items()}


def _bits(tensor: torch.Tensor) -> bytes:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _snapshot(optimizer: DMuon, params: dict[str, nn.Parameter]) -> dict[str, Any]:
    found: dict[str, Any] = {name: _bits(p) for name, p in params.items()}
    for name, param in params.items():
        for key, value in sorted(optimizer.state[param].items()):
            found[f"{name}/{key}"] = _bits(value) if isinstance(value, torch.Tensor) else value
    found["skipped_steps"] = optimizer.skipped_steps
    return found


def run(layout: str, variant: str, capturable: bool, nan_rank: int | None) -> dict[str, Any]:
    """STEPS steps under the schedules; a NaN in one grad of ``nan_rank`` at BAD_STEP."""
    mesh, cases = _layout(layout)
    params = {n: nn.Parameter(as_dtensor(t, mesh, cases[n][1])) for n, t in _full(0, cases).items()}
    optimizer = DMuon(list(params.items()), lr=0.03, momentum=0.9, weight_decay=WEIGHT_DECAYS[0],
                      skip_nonfinite=True, capturable=capturable, **VARIANTS[variant])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    for step in range(STEPS):
        set_weight_decay(optimizer, WEIGHT_DECAYS[step])
        for name, grad in _full(100 + step, cases).items():
            if step == BAD_STEP and dist.get_rank() == nan_rank and name == POISONED[layout]:
                grad[-1, 0] = float("nan")  # in the last rows block: the last rank's only (its replica's grad is clean)
            params[name].grad = as_dtensor(grad, mesh, cases[name][1])
        optimizer.step()
        schedule.step()
    optimizer.state_dict()  # settles the last step's status (the skipped count)
    return _snapshot(optimizer, params)


def capturable_matches(layout: str, variant: str, nan_rank: int | None = None) -> dict[str, Any]:
    """``capturable`` on and off, bit for bit on this rank: the keys that differ (none expected)."""
    off = run(layout, variant, False, nan_rank)
    on = run(layout, variant, True, nan_rank)
    # Both key sets: a state key only the capturable run makes is a difference too.
    return {"differ": sorted(k for k in off.keys() | on.keys() if off.get(k) != on.get(k)),
            "skipped": on["skipped_steps"]}


def _fsdp_run(capturable: bool, steps: range, checkpoint: tuple[str, str] | None = None) -> dict[str, Any]:
    """The FSDP layout stepped over ``steps`` under the schedules. ``checkpoint``: ("save", dir)
    writes a DCP checkpoint after the steps (the scheduler's state with it); ("load", dir)
    loads one into fresh parameters, optimizer and scheduler before them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    mesh, cases = _layout("fsdp")
    start = _full(0, cases)
    if checkpoint is not None and checkpoint[0] == "load":
        start = {n: torch.zeros_like(t) for n, t in start.items()}
    params = {n: nn.Parameter(as_dtensor(t, mesh, cases[n][1])) for n, t in start.items()}
    optimizer = DMuon(list(params.items()), lr=0.03, momentum=0.9, weight_decay=WEIGHT_DECAYS[0], normuon=True,
                      skip_nonfinite=True, capturable=capturable)
    module = nn.ParameterDict({n: p for n, p in params.items()})
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)  # before a load, as TorchTitan makes it

    def saved() -> dict[str, Any]:
        return {"model": module.state_dict(), "optim": get_optimizer_state_dict(module, optimizer),
                "schedule": schedule.state_dict()}

    if checkpoint is not None and checkpoint[0] == "load":
        target = saved()
        dcp.load(target, checkpoint_id=checkpoint[1])
        module.load_state_dict(target["model"])
        set_optimizer_state_dict(module, optimizer, target["optim"])
        schedule.load_state_dict(target["schedule"])
    for step in steps:
        set_weight_decay(optimizer, WEIGHT_DECAYS[step])
        for name, grad in _full(100 + step, cases).items():
            params[name].grad = as_dtensor(grad, mesh, cases[name][1])
        optimizer.step()
        schedule.step()
    if checkpoint is not None and checkpoint[0] == "save":
        dcp.save(saved(), checkpoint_id=checkpoint[1])
    return {n: p.full_tensor() for n, p in params.items()}


def checkpoint_save(checkpoint_dir: str, done: int) -> None:
    """``done`` capturable steps on this world size, then a DCP checkpoint."""
    _fsdp_run(True, range(done), ("save", checkpoint_dir))


def checkpoint_resume(checkpoint_dir: str, done: int) -> dict[str, bool]:
    """That checkpoint loaded into a fresh capturable optimizer on this world size, steps
    ``done..STEPS``, against an uninterrupted ``capturable=False`` run: per parameter, bitwise
    equal."""
    resumed = _fsdp_run(True, range(done, STEPS), ("load", checkpoint_dir))
    uninterrupted = _fsdp_run(False, range(STEPS))
    return {n: torch.equal(resumed[n], uninterrupted[n]) for n in resumed}


def cuda_graph_schedule_replay(steps: int = 20) -> dict[str, Any]:
    """The FSDP layout on CUDA, twice: one ``capturable`` DMuon stepped eagerly, one through
    ``dmuon.capture.cuda_graphs.CapturedStep`` (captured once, then replayed), under a cosine schedule
    and the weight-decay schedule, with a NaN grad at one step (``skip_nonfinite``), the grads
    copied in place as a captured step needs: whether every parameter is bitwise equal, and
    each twin's skipped-step count."""
    from dmuon.capture.cuda_graphs import CapturedStep

    mesh, cases = _layout("fsdp")
    twins = []
    for _ in range(2):
        params = {n: nn.Parameter(as_dtensor(t, mesh, cases[n][1])) for n, t in _full(0, cases).items()}
        for name, param in params.items():
            param.grad = as_dtensor(torch.zeros(cases[name][0], device=_device()), mesh, cases[name][1])
        optimizer = DMuon(list(params.items()), lr=0.03, momentum=0.9, skip_nonfinite=True, capturable=True)
        twins.append((params, optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)))
    (eager_params, eager, eager_lr), (graph_params, graphed, graph_lr) = twins
    replay = CapturedStep(graphed)
    for step in range(steps):
        for optimizer in (eager, graphed):
            set_weight_decay(optimizer, WEIGHT_DECAYS[step % len(WEIGHT_DECAYS)])
        for name, grad in _full(100 + step, cases).items():
            if step == steps // 2 and name == POISONED["fsdp"]:
                grad[-1, 0] = float("nan")
            for params in (eager_params, graph_params):
                params[name].grad.to_local().copy_(as_dtensor(grad, mesh, cases[name][1]).to_local())
        eager.step()
        eager_lr.step()
        replay.step()
        graph_lr.step()
        replay.check()
    torch.cuda.synchronize()
    equal = all(torch.equal(eager_params[n].to_local(), graph_params[n].to_local()) for n in eager_params)
    replay.release()
    return {"equal": equal, "skipped": (eager.skipped_steps, graphed.skipped_steps)}


def capturable_cases(layout: str, variants: list[str], with_nan: bool) -> dict[str, dict[str, Any]]:
    """:func:`capturable_matches` for each of ``variants`` and, with ``with_nan``, once more
    (plain) with a NaN on the last rank: one launch for them all."""
    found = {variant: capturable_matches(layout, variant) for variant in variants}
    if with_nan:
        found["nan"] = capturable_matches(layout, "plain", dist.get_world_size() - 1)
    return found


def cuda_graph_guards(steps: int = 6) -> dict[str, Any]:
    """Issue 50's defects on one GPU, each as what a captured step does about it (plain CUDA
    parameters; an eager twin steps the same grads and hyperparameters):

    - ``replaced_grad``: a grad replaced after the capture (``zero_grad(set_to_none=True)``
      and a new one) is refused before the replay, naming the parameter;
    - ``load_reaches_graph``: after both twins load a third optimizer's state, the replays
      stay bitwise equal to the eager twin's steps;
    - ``lr_numbers``: a number written to ``lr`` before the capture and between replays
      (bitwise equal to the eager twin, no capture failure);
    - ``skipped_once``: a NaN grad in one replay, ``check()`` called twice: counted once;
    - ``side_stream_joined``: a warm-up step that raises after writing on the side stream:
      the default stream sees the write."""
    from dmuon.capture.cuda_graphs import CapturedStep

    device = _device()
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(48, 32, generator=generator) for _ in range(3)]
    grads = [[torch.randn(48, 32, generator=generator) for _ in start] for _ in range(2 * steps)]

    def twin(**options: Any) -> tuple[list[tuple[str, nn.Parameter]], DMuon]:
        params = [(f"w{i}", nn.Parameter(w.to(device))) for i, w in enumerate(start)]
        for _, p in params:
            p.grad = torch.zeros_like(p)
        return params, DMuon(params, lr=0.02, weight_decay=0.1, capturable=True, skip_nonfinite=True, **options)

    def feed(params, step: int, nan: bool = False) -> None:
        for (_, p), g in zip(params, grads[step]):
            p.grad.copy_(g.to(device))
            if nan:
                p.grad[0, 0] = float("nan")

    found: dict[str, Any] = {}
    (eager_params, eager), (graph_params, graphed) = twin(), twin()
    other_params, other = twin()
    replay = CapturedStep(graphed, warmup_steps=2)
    for step in range(steps):
        lr = 0.02 * (1 - step / (2 * steps))
        for optimizer in (eager, graphed):
            optimizer.param_groups[0]["lr"] = lr  # a number: copied into the tensor the graph reads
        feed(eager_params, step), feed(graph_params, step)
        eager.step()
        replay.step()
    torch.cuda.synchronize()
    found["lr_numbers"] = all(torch.equal(a, b) for (_, a), (_, b) in zip(eager_params, graph_params))
    feed(other_params, steps)
    other.step()
    saved = other.state_dict()
    eager.load_state_dict(saved)
    graphed.load_state_dict(saved)
    for step in range(steps, 2 * steps):
        feed(eager_params, step, nan=step == steps + 1), feed(graph_params, step, nan=step == steps + 1)
        eager.step()
        replay.step()
    replay.check()
    replay.check()
    torch.cuda.synchronize()
    found["load_reaches_graph"] = all(torch.equal(a, b) for (_, a), (_, b) in zip(eager_params, graph_params))
    found["skipped_once"] = graphed.skipped_steps == 1
    graph_params[0][1].grad = None
    graph_params[0][1].grad = torch.zeros_like(graph_params[0][1])
    try:
        replay.step()
        found["replaced_grad"] = "replayed"
    except RuntimeError as error:
        found["replaced_grad"] = "the grad of 'w0'" in str(error)
    replay.release()

    written = torch.zeros(1 << 22, device=device)
    raising = CapturedStep(twin()[1], warmup_steps=1)

    def write_then_raise() -> None:
        for _ in range(20):  # long enough to still run when the caller's stream reads
            written.add_(1.0)
        raise ValueError("a warm-up step that raises")

    raising.optimizer.step = write_then_raise
    try:
        raising.step()
    except ValueError:
        pass
    found["side_stream_joined"] = bool((written == 20.0).all().item())
    return found
