"""The runs behind tests/test_switch_combinations.py: one small model stepped under one
combination of DMuon's step switches, with a fault at one step, in this process (P = 1,
plain tensors) or on each of 2 gloo ranks (P = 2, FSDP-style ``Shard(0)`` DTensors, the
fault on one rank only). Each check answers None (held) or what differed, so a failure
names the combination and the tensor."""

from __future__ import annotations

import dataclasses
import itertools
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from benchmarks.layouts import as_dtensor
from dmuon import AttentionHeads, DMuon

IMPLEMENTATIONS = {"for_loop": {"foreach": False, "fused": None}, "foreach": {"foreach": True, "fused": None},
                   "fused": {"fused": True}}
THRESHOLD = 5.0  # the synthetic logits below are ~15-30: every step clips
VARIANTS = {"plain": {}, "normuon": {"normuon": True}, "cautious": {"cautious_weight_decay": True},
            "qk_clip": {"qk_clip_threshold": THRESHOLD}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOMENTUM_DTYPES = {"param": None, "bf16": "bfloat16", "int8": "int8"}  # how the momentum is kept
ADAMW_STATE_DTYPES = MOMENTUM_DTYPES  # how the AdamW part keeps its moments (of embed.weight: 2-D)
FAULTS = ("none", "nan", "inf", "invalid")
HEADS = AttentionHeads(2, 2, 4)  # multi-head: a clip scales rows of W_q and of W_k
MUON = {"attn.wq": (8, 6), "attn.wk": (8, 6), "experts": (2, 4, 6)}
ADAMW = {"bias": (5,), "embed.weight": (9, 6)}  # 5 and 9 rows: uneven shards at P = 2
# (parameter, element, value, rank) of each fault: NaN in a Muon grad, inf in an AdamW
# grad, a float64 grad (``dmuon.step.grad_checks``: the step raises, naming the parameter).
FAULT_AT = {"nan": ("attn.wq", (-1, 1), float("nan"), 1), "inf": ("embed.weight", (-1, 2), float("inf"), 0),
            "invalid": ("bias", None, None, 1)}
GOOD_STEPS = (0, 1, 2)  # seeds of the good grads; the faulty step comes after the first
FAULTY_SEED = 50


@dataclasses.dataclass(frozen=True)
class Combination:
    capturable: bool
    implementation: str
    variant: str
    dtype: str
    fault: str
    world: int
    momentum: str = "param"
    adamw_state: str = "param"

    @property
    def name(self) -> str:
        kept = "" if self.momentum == "param" else f"-momentum_{self.momentum}"
        kept += "" if self.adamw_state == "param" else f"-adamw_state_{self.adamw_state}"
        return (f"P{self.world}-{'capturable' if self.capturable else 'host_lr'}-{self.implementation}-"
                f"{self.variant}-{self.dtype}-{self.fault}{kept}")

def every_combination() -> list[Combination]:
    """The full matrix, less capturable + foreach: refused at construction on the CPU
    (docs/optimizer.md, "Capturable": "foreach=True there is refused at construction")."""
    values = itertools.product((False, True), IMPLEMENTATIONS, VARIANTS, DTYPES, FAULTS, (1, 2), MOMENTUM_DTYPES,
                               ADAMW_STATE_DTYPES)
    return [c for c in itertools.starmap(Combination, values) if not (c.capturable and c.implementation == "foreach")]


def pairwise_sample(required: list[Combination]) -> list[Combination]:
    """``required``, then greedily the combination covering most still-uncovered value
    pairs (first in matrix order on ties) until every possible pair of two switches'
    values appears: deterministic."""
    every = every_combination()

    def pairs(c: Combination) -> set[tuple[tuple[int, Any], tuple[int, Any]]]:
        return set(itertools.combinations(enumerate(dataclasses.astuple(c)), 2))

    uncovered = set().union(*map(pairs, every)) - set().union(*map(pairs, required))
    sample = list(required)
    while uncovered:
        best = max(every, key=lambda c: len(pairs(c) & uncovered))
        sample.append(best)
        uncovered -= pairs(best)
    return sample


# ----------------------------------------------------------------------- one run


def _full(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=generator) for n, shape in shapes.items()}


def _place(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    return tensor if mesh is None else as_dtensor(tensor, mesh, [Shard(0)])


def _set_grads(c: Combination, params: dict[str, nn.Parameter], mesh: Any, seed: int, faulty: bool) -> None:
    rank = dist.get_rank() if mesh is not None else 0
    for name, full in _full({**MUON, **ADAMW}, seed).items():
        params[name].grad = _place(full.to(DTYPES[c.dtype]), mesh)
    if not faulty:
        return
    name, element, value, on_rank = FAULT_AT[c.fault]
    if rank != on_rank % c.world:
        return
    if element is None:  # an invalid grad: another dtype, let through autograd's own check
        params[name].grad_dtype = None
        params[name].grad = params[name].grad.double()
    else:  # at ``element`` of this rank's local block
        _local(params[name].grad)[element] = value


def _report_logits(optimizer: DMuon, seed: int, rank: int) -> None:
    """This rank's q, k for the attention: synthetic (std 3), seeded by step and rank, so that
    a run with and one without a faulty step report the same logits at each good step; they
    are well above THRESHOLD (every step clips)."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    q, k = (torch.randn(1, HEADS.n_heads, 4, HEADS.head_dim, generator=generator) * 3 for _ in range(2))
    optimizer.max_logits.observe("attn", q, k, n_heads=HEADS.n_heads)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _tensor(value: torch.Tensor) -> torch.Tensor:
    return _local(value).detach().clone()


def snapshot(optimizer: DMuon, params: dict[str, nn.Parameter]) -> dict[str, Any]:
    """This rank's parameters and whole ``state_dict()`` (local tensors, cloned), by name."""
    names = {id(p): n for n, p in params.items()}
    found: dict[str, Any] = {f"param {n}": _tensor(p) for n, p in params.items()}
    saved = optimizer.state_dict()
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for param, index in zip(group["params"], saved_group["params"]):
            for key, value in saved["state"].get(index, {}).items():
                found[f"state {names[id(param)]}.{key}"] = _tensor(value) if torch.is_tensor(value) else value
    for i, group in enumerate(saved["param_groups"]):
        found.update({f"group {i}.{k}": _tensor(v) if torch.is_tensor(v) else v for k, v in group.items()})
    return found


@dataclasses.dataclass
class Run:
    snapshots: list[dict[str, Any]]  # before the faulty step, then after it and each step that raised
    errors: list[str | None]  # each step's error, in order
    skipped: int
    final: dict[str, Any]


@lru_cache(maxsize=None)
def run(c: Combination, skip_nonfinite: bool) -> Run:
    """The good steps, with the faulty step after the first (none for fault "none"); a good
    step that raises is retried once with the same grads."""
    mesh = init_device_mesh("cpu", (c.world,)) if c.world > 1 else None
    rank = dist.get_rank() if mesh is not None else 0
    params = {n: nn.Parameter(_place(t.to(DTYPES[c.dtype]), mesh)) for n, t in _full({**MUON, **ADAMW}, 0).items()}
    optimizer = DMuon([{"params": [(n, params[n]) for n in MUON], "use_muon": True},
                       {"params": [(n, params[n]) for n in ADAMW], "use_muon": False}],
                      lr=0.02, weight_decay=0.1, adamw_lr=0.01, adamw_weight_decay=0.1, ns_dtype="float32",
                      capturable=c.capturable, skip_nonfinite=skip_nonfinite, momentum_dtype=MOMENTUM_DTYPES[c.momentum],
                      adamw_state_dtype=ADAMW_STATE_DTYPES[c.adamw_state],
                      **IMPLEMENTATIONS[c.implementation], **VARIANTS[c.variant])
    if c.variant == "qk_clip":
        optimizer.clip_attention("attn", params["attn.wq"], params["attn.wk"], HEADS)

    def step(seed: int, faulty: bool = False) -> str | None:
        _set_grads(c, params, mesh, seed, faulty)
        if c.variant == "qk_clip":
            _report_logits(optimizer, seed, rank)
        try:
            optimizer.step()
        except Exception as error:  # noqa: BLE001 - the checks read the type and message
            return f"{type(error).__name__}: {error}"
        return None

    errors, snapshots = [step(GOOD_STEPS[0])], []
    if c.fault != "none":
        snapshots.append(snapshot(optimizer, params))
        errors.append(step(FAULTY_SEED, faulty=True))
        snapshots.append(snapshot(optimizer, params))
    for seed in GOOD_STEPS[1:]:
        errors.append(step(seed))
        if errors[-1] is not None:  # the ranks' error raised one step late: that step too must change nothing
            snapshots.append(snapshot(optimizer, params))
            errors.append(step(seed))
    final = snapshot(optimizer, params)
    return Run(snapshots, errors, optimizer.skipped_steps, final)


# ----------------------------------------------------------------------- the checks


def _differ(a: dict[str, Any], b: dict[str, Any], bf16_ulps: int = 0, groups: bool = True,
            near: tuple[str, ...] = tuple(MUON)) -> str | None:
    """The names whose values differ: tensors bit for bit (NaN-safe); the bf16 parameters
    named in ``near`` within ``bf16_ulps`` units in the last place if given; ``param_groups``
    unless not ``groups``."""
    wrong = sorted(set(a) ^ set(b))
    for key in sorted(k for k in set(a) & set(b) if groups or not k.startswith("group")):
        x, y = a[key], b[key]
        if not (torch.is_tensor(x) and torch.is_tensor(y)):
            same = type(x) is type(y) and x == y
        elif x.dtype != y.dtype or x.shape != y.shape:
            same = False
        elif bf16_ulps and key.removeprefix("param ") in near:
            same = bool(((x.view(torch.int16).int() - y.view(torch.int16).int()).abs() <= bf16_ulps).all())
        else:
            same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        if not same:
            wrong.append(key)
    return f"differ: {wrong}" if wrong else None


def _errors_as_documented(c: Combination, r: Run, rank: int) -> str | None:
    """nan/inf: no error, one skipped step. invalid (docs/optimizer.md, "Behaviour on bad
    input"): the faulty rank raises ValueError naming the parameter; at P = 2 every rank
    raises ValueError at its next step, which changes nothing either and is retried."""
    if c.fault in ("nan", "inf"):
        ok = r.errors == [None] * (len(GOOD_STEPS) + 1) and r.skipped == 1
    else:
        faulty_rank = rank == FAULT_AT["invalid"][3] % c.world
        raised = [e is not None for e in r.errors]
        ok = (r.skipped == 0 and raised == [False, faulty_rank] + [True] * (c.world > 1) + [False, False]
              and all(e.startswith("ValueError: DMuon: ") for e in r.errors if e is not None)
              and (not faulty_rank or "parameter 'bias'" in r.errors[1]))
    return None if ok else f"errors {r.errors}, skipped {r.skipped}"


def checks(c: Combination) -> dict[str, str | None]:
    """Each check's answer for ``c`` on this rank: None where it held."""
    skip = c.fault in ("nan", "inf")  # skip_nonfinite for the non-finite faults, and for their reference runs
    r, rank = run(c, skip), dist.get_rank() if c.world > 1 else 0
    found: dict[str, str | None] = {}
    if c.fault != "none":
        found["unchanged"] = next(filter(None, (_differ(r.snapshots[0], s) for s in r.snapshots[1:])), None)
        found["without"] = _differ(r.final, run(dataclasses.replace(c, fault="none"), skip).final)
        found["errors"] = _errors_as_documented(c, r, rank)
    if c.capturable:
        # docs/optimizer.md, "Capturable": "bf16 or fp16 parameters on the CPU: add_'s vector
        # loop equals addcmul_, but the elements its loop leaves over round alpha * update to the
        # parameter's dtype first ...: those few elements may differ by one rounding." So bf16
        # Muon parameters (Muon's update is that add_) may be one rounding apart per step; and
        # "Fused AdamW on bf16 or fp16 parameters": the decay rounds apart from torch's fused
        # kernel (not with cautious decay, which runs before the kernel either way).
        near = tuple(MUON) + (tuple(ADAMW) if c.implementation == "fused" and c.variant != "cautious" else ())
        found["capturable"] = _differ(r.final, run(dataclasses.replace(c, capturable=False), skip).final,
                                      bf16_ulps=len(GOOD_STEPS) if c.dtype == "bf16" else 0, groups=False, near=near)
    return found


def checks_on_ranks(combinations: list[Combination]) -> dict[str, dict[str, str | None]]:
    """:func:`checks` for each combination, on this rank: one launch for them all."""
    return {c.name: checks(c) for c in combinations}
