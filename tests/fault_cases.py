"""The fault sweep's cases (issue 40, item 8): a seeded generator of rank-asymmetric faults.

A case is one fault at one step ``k`` of a small model, on P gloo ranks:

- ``kind``: what is wrong with the grad (:data:`KINDS`);
- ``where``: which parameter gets it (:data:`WHERES`);
- ``ranks``: which ranks see it (a concrete set, drawn as "one", "some" or "all");
- ``layout`` and ``setting``: how the model is laid out and which options DMuon runs with;
- ``adtype``: DMuon's ``adamw_state_dtype`` (``param``: None, ``bf16``, ``int8``), the form of
  the AdamW part's moments of its matrix (``tests.fault_model``'s ``emb``), so a step that
  raises or is skipped must leave int8 values and scales, or bf16 moments, as they were.

Its id spells every field (``P4-hsdp-telemetry-nan-muon-r1.3-k1``, and ``-a<adtype>`` at its
end where that is not ``param``: ``P4-hsdp-telemetry-nan-muon-r1.3-k1-aint8``), so any failure
can be rerun alone from the id (``python -m tests.fault_sweep --case ID``) without the seed
that drew it. Pure Python: no torch, no process group, so every rank (and the driver) builds the
same list from the same seed.

What each case must do is the contract of issue 40 (the fixed behaviour), written down
here as an :class:`Expected` outcome per rank set (one per DMuon: a pipeline stage has
its own); ``tests.fault_checks`` holds the observations against it.
"""

from __future__ import annotations

import functools
import itertools
import random
import zlib
from dataclasses import dataclass

KINDS = ("none", "sparse", "complex", "nan", "inf", "global_shape", "local_shape", "partial", "replicate",
         "other_mesh", "dtype", "qk_no_report")
# muon/adamw/adamw_matrix/experts/qk_head/normuon/replicated: DTensor parameters (adamw_matrix:
# an embedding-like matrix of the AdamW part; replicated: on every dim of its mesh, so its grad
# may be Partial); plain_*: plain tensors (per process).
WHERES = ("muon", "adamw", "adamw_matrix", "plain_muon", "plain_adamw", "experts", "qk_head", "normuon",
          "replicated")
RANK_CLASSES = ("one", "some", "all")
LAYOUTS = ("fsdp", "hsdp", "two_meshes", "pp")
SETTINGS = ("base", "telemetry", "qk_clip", "normuon", "cautious", "foreach_on", "foreach_off", "fused",
            "skip_nonfinite")
WORLDS = (2, 4)
ADTYPES = ("param", "bf16", "int8")  # adamw_state_dtype: None, bf16, int8
STEPS_BEFORE = (0, 1)  # clean steps before the faulty one (0: the fault meets the state-making step)

# The parameter each ``where`` names (tests.fault_runner builds them).
TARGET = {"muon": "w", "adamw": "norm", "adamw_matrix": "emb", "plain_muon": "pw", "plain_adamw": "pb",
          "experts": "experts", "qk_head": "attn_a.wq", "normuon": "nm", "replicated": "rn"}
DTENSOR_WHERES = frozenset({"muon", "adamw", "adamw_matrix", "experts", "qk_head", "normuon", "replicated"})
# Faults that are no error: the step runs on every rank (None everywhere: skipped; NaN/inf: applied).
VALUE_KINDS = frozenset({"nan", "inf"})
# A grad laid out otherwise than its parameter: a replicated grad of a sharded parameter is cut
# locally; a Partial one is summed for a parameter replicated on every mesh dim (by every rank:
# Partial on some ranks only is a disagreement) and refused for any other.
PLACEMENT_KINDS = frozenset({"partial", "replicate"})
INVALID_KINDS = frozenset({"sparse", "complex", "global_shape", "local_shape", "other_mesh", "dtype"})

# The texts the contract fixes (prefixes; ``{n}`` the number of ranks with a problem).
LOCAL_ERROR = "ValueError: DMuon: parameter '{name}': "
AGREED_ERROR = "ValueError: DMuon: {n} rank(s) found an invalid gradient"
DISAGREE_ERROR = "RuntimeError: DMuon: ranks disagree on which parameters have gradients: "


@dataclass(frozen=True)
class Case:
    world: int
    layout: str
    setting: str
    kind: str
    where: str
    ranks: tuple[int, ...]
    k: int  # the faulty step's index (clean steps 0..k-1 before it)
    adtype: str = "param"  # adamw_state_dtype

    @property
    def id(self) -> str:
        ranks = "all" if self.ranks == tuple(range(self.world)) else "r" + ".".join(map(str, self.ranks))
        adamw = "" if self.adtype == "param" else f"-a{self.adtype}"
        return f"P{self.world}-{self.layout}-{self.setting}-{self.kind}-{self.where}-{ranks}-k{self.k}{adamw}"

    @property
    def target(self) -> str:
        return TARGET[self.where]

    @property
    def qk(self) -> bool:
        """Whether the attentions are registered for QK-clip (the setting, or a fault on a head)."""
        return self.setting == "qk_clip" or self.where == "qk_head"


def parse(case_id: str) -> Case:
    """The case an id names (the inverse of :attr:`Case.id`)."""
    fields = case_id.split("-")
    adtype = fields.pop().removeprefix("a") if len(fields) == 8 else "param"
    world, layout, setting, kind, where, ranks, k = fields
    world_size = int(world.removeprefix("P"))
    rank_set = tuple(range(world_size)) if ranks == "all" else tuple(int(r) for r in ranks[1:].split("."))
    case = Case(world_size, layout, setting, kind, where, rank_set, int(k.removeprefix("k")), adtype)
    if case.id != case_id or adtype not in ADTYPES:
        raise ValueError(f"not a fault-sweep case id: {case_id!r}")
    return case


def skip_reason(world: int, layout: str, setting: str, kind: str, where: str, rank_class: str, k: int) -> str | None:
    """Why a combination makes no sense (recorded, not run), or None."""
    if layout == "hsdp" and world != 4:
        return "HSDP 2 x 2 needs 4 ranks"
    if rank_class == "some" and world == 2:
        return "at 2 ranks 'some' is 'one'"
    if kind == "qk_no_report":
        if where != "qk_head":
            return "a missing QK-clip report belongs to an attention (where=qk_head)"
        if rank_class != "all":
            return "'never reports' is an attention no rank reports (one rank's silence still leaves the MAX)"
        if k != 0:
            return "'never reports' starts at the first step"
    if kind in VALUE_KINDS and where == "replicated" and rank_class != "all":
        return ("a replicated grad whose values differ across ranks has no one-process view (the mesh's first "
                "rank's is summed)")
    if kind == "sparse" and where in DTENSOR_WHERES:
        return "a DTensor cannot hold a sparse local tensor (torch 2.13: DTensor.from_local fails)"
    if kind in PLACEMENT_KINDS | {"other_mesh", "local_shape"} and where not in DTENSOR_WHERES:
        return "placement and mesh faults need a DTensor parameter"
    return None


def _ranks_for(world: int, rank_class: str, key: str) -> tuple[int, ...]:
    """A concrete rank set for a class, drawn from the case's other fields (stable across runs)."""
    draw = random.Random(zlib.crc32(key.encode()))
    if rank_class == "all":
        return tuple(range(world))
    if rank_class == "one":
        return (draw.randrange(world),)
    size = draw.randrange(2, world)
    return tuple(sorted(draw.sample(range(world), size)))


def all_cases(worlds: tuple[int, ...] = WORLDS) -> tuple[list[Case], list[tuple[str, str]]]:
    """Every case the generator knows, and every skipped combination with its reason
    (``(description, reason)``), in a fixed order. A case's ranks are drawn from its fields but
    ``adtype`` (the same ranks under each AdamW state dtype)."""
    cases, skipped = _every_case(tuple(worlds))
    return list(cases), list(skipped)


@functools.lru_cache(maxsize=8)
def _every_case(worlds: tuple[int, ...]) -> tuple[tuple[Case, ...], tuple[tuple[str, str], ...]]:
    """:func:`all_cases`, made once per ``worlds`` (the sample and the tests ask often)."""
    cases, skipped = [], []
    for world, layout, setting, kind, where, rank_class, k in itertools.product(
            worlds, LAYOUTS, SETTINGS, KINDS, WHERES, RANK_CLASSES, STEPS_BEFORE):
        reason = skip_reason(world, layout, setting, kind, where, rank_class, k)
        key = f"P{world}-{layout}-{setting}-{kind}-{where}-{rank_class}-k{k}"
        if reason:
            skipped += [(key + ("" if adtype == "param" else f"-a{adtype}"), reason) for adtype in ADTYPES]
            continue
        ranks = _ranks_for(world, rank_class, key)
        cases += [Case(world, layout, setting, kind, where, ranks, k, adtype) for adtype in ADTYPES]
    return tuple(cases), tuple(skipped)


def sample(n: int, seed: int, worlds: tuple[int, ...] = WORLDS) -> list[Case]:
    """``n`` cases drawn without replacement by ``seed`` (all of them if ``n`` is larger),
    stratified so that every fault kind comes up: round-robin over the kinds, each kind's
    cases shuffled."""
    cases, _ = all_cases(worlds)
    draw = random.Random(seed)
    by_kind: dict[str, list[Case]] = {}
    for case in cases:
        by_kind.setdefault(case.kind, []).append(case)
    for group in by_kind.values():
        draw.shuffle(group)
    picked: list[Case] = []
    for column in itertools.zip_longest(*by_kind.values()):
        picked += [c for c in column if c is not None]
        if len(picked) >= n:
            break
    return picked[:n]


# ------------------------------------------------------------------- the contract per case


def stage_ranks(case: Case, rank: int) -> tuple[int, ...]:
    """The ranks of the DMuon that ``rank`` steps: every rank, or its pipeline stage's."""
    if case.layout != "pp":
        return tuple(range(case.world))
    half = case.world // 2
    return tuple(range(half)) if rank < half else tuple(range(half, case.world))


# Under two_meshes these parameters live on the grid's row (tests.fault_model.ROW_PARAMS).
ROW_TARGETS = frozenset({"w", "norm"})


def target_meshes(case: Case, scope: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The rank sets of the target's meshes within a DMuon's ranks: one, or under
    two_meshes one per row of the grid for a row parameter (a tensor of its own per row)."""
    if case.layout == "two_meshes" and case.target in ROW_TARGETS:
        row = case.world // 2
        return [tuple(range(start, start + row)) for start in range(0, case.world, row)]
    return [scope]


@dataclass(frozen=True)
class Expected:
    """What the contract says one DMuon (its ranks ``scope``) does in a case.

    ``outcome``: ``"clean"`` (no fault reaches this DMuon), ``"valid"`` (a fault that is
    no error: every step returns, the result is one process's on the same grads),
    ``"skipped"`` (a NaN or inf under ``skip_nonfinite``: no error, step ``k`` changes
    nothing on any rank, the result is one process's without step ``k``),
    ``"local_error"``, ``"disagree"``, ``"local_error_or_agreed"`` (an error the same on
    every rank by the next step, raised at the faulty step by the faulty ranks or by no
    rank) or ``"qk"`` (an agreed QK-clip error)."""

    scope: tuple[int, ...]
    outcome: str
    faulty: tuple[int, ...]  # the ranks of this DMuon that see the fault


def expected(case: Case, rank: int) -> Expected:
    """The contract's outcome for the DMuon ``rank`` steps (docstring of :class:`Expected`)."""
    scope = stage_ranks(case, rank)
    faulty = tuple(r for r in case.ranks if r in scope)
    if not faulty:
        return Expected(scope, "clean", faulty)
    if case.kind == "qk_no_report":
        return Expected(scope, "qk", faulty)
    if case.kind in VALUE_KINDS:  # applied as torch.optim.Muon does, or skipped everywhere (skip_nonfinite)
        return Expected(scope, "skipped" if case.setting == "skip_nonfinite" else "valid", faulty)
    if case.kind == "none":
        if case.where not in DTENSOR_WHERES:
            return Expected(scope, "valid", faulty)  # plain tensors are per process
        # A DTensor's grad present on some ranks of its mesh only; None on a whole mesh is a skip.
        split = any(0 < len(set(mesh) & set(faulty)) < len(mesh) for mesh in target_meshes(case, scope))
        return Expected(scope, "disagree" if split else "valid", faulty)
    if case.kind == "replicate":  # still the grad: cut locally where the parameter is sharded
        return Expected(scope, "valid", faulty)
    if case.kind == "partial":
        if case.where != "replicated":
            return Expected(scope, "local_error", faulty)
        # Summed by every rank; Partial on some ranks and replicated on others: every rank raises.
        return Expected(scope, "valid" if faulty == scope else "local_error_or_agreed", faulty)
    return Expected(scope, "local_error", faulty)
