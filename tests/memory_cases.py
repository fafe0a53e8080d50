"""The memory sweep's cases (issue 67, item 2): a seeded generator of small models of narrow,
single-row, single-column, wide and 3-D Muon parameters, some of which never get a grad,
each stepped on P gloo ranks and held to its memory (``tests.memory_sweep``).

A case is one model (its shapes and which parameters stay frozen drawn from ``seed`` and
P) under one configuration:

- ``world`` and ``layout``: P = 1, 2 or 4; ``fsdp``: every parameter a ``Shard(0)``
  DTensor (FSDP2's layout: the owner exchange's fast path at P >= 2, the local path at
  P = 1), ``plain``: plain tensors (P = 1 only);
- ``pdtype``: the parameters' dtype (fp32, sometimes bf16);
- ``mdtype``: DMuon's ``momentum_dtype`` (``param``: None, ``bf16``, ``int8``);
- ``form``: ``loop`` (foreach=False), ``foreach`` or ``capturable``;
- ``chunk``: how many elements of momentum a step reads, rounds and packs at once: ``lib``,
  the library's own (2^24: at these sizes every momentum of a rank in one chunk), or
  ``c1k``, 1,024 (:data:`CHUNKS`; ``tests.memory_sweep.chunked`` sets them on the ranks), so
  a rank's momenta are read in several chunks and larger tensors alone, as at scale.

Its id spells every field (``P2-fsdp-fp32-int8-foreach-c1k-s17``), so a failure reruns alone
(``python -m tests.memory_sweep --case ID``). The model (:func:`params_of`) is a function of
``seed`` and P alone: the same shapes under every dtype, so a case's peak can be held to
the same model's with fp32 momentum (``mdtype`` ``param``). Pure Python, no torch: every
rank and the driver build the same cases.

The models: 2 to 4 matrices whose rows are 1 to 130 elements wide (int8's 128-element
block and below it: a scale per row; the sample (:func:`sample`) picks models that bring
widths not yet seen, on parameters with a grad, so 60 cases cover every width 1..130 and
150 every width with int8 momentum), often a
single-row ``(1, n)`` and a single-column ``(n, 1)`` matrix, a wider one (a whole block and
a short one, or whole blocks), a 3-D expert stack; each parameter frozen (never a grad,
``requires_grad`` still True) with probability :data:`FROZEN_P`. Every tensor holds at
most :data:`MAX_NUMEL` elements: a case runs in about a second at P = 1 and 2 on 2 cores.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

WORLDS = (1, 2, 4)
PDTYPES = ("fp32", "bf16")
MDTYPES = ("param", "bf16", "int8")
FORMS = ("loop", "foreach", "capturable")
# Elements of momentum read (and rounded, and packed) at once: None, the library's own.
CHUNKS = {"lib": None, "c1k": 1024}
SHAPE_SEEDS = 100_000
MAX_NUMEL = 4096  # per tensor
NARROWEST, WIDEST_NARROW = 1, 130  # the widths every sample should cover
WIDE = (200, 256, 300, 384, 520)
FROZEN_P = 0.2
BF16_P = 0.25  # how often a drawn case's parameters are bf16 (the sample makes sure of both)


def layouts_for(world: int) -> tuple[str, ...]:
    return ("plain", "fsdp") if world == 1 else ("fsdp",)


@dataclass(frozen=True)
class Case:
    world: int
    layout: str
    pdtype: str
    mdtype: str
    form: str
    chunk: str
    seed: int

    @property
    def id(self) -> str:
        return f"P{self.world}-{self.layout}-{self.pdtype}-{self.mdtype}-{self.form}-{self.chunk}-s{self.seed}"

    @property
    def baseline(self) -> Case:
        """The same model and options with fp32 momentum (the parameter's dtype): check c's reference."""
        return replace(self, mdtype="param")


def parse(case_id: str) -> Case:
    """The case an id names (the inverse of :attr:`Case.id`)."""
    try:
        world, layout, pdtype, mdtype, form, chunk, seed = case_id.split("-")
        case = Case(int(world.removeprefix("P")), layout, pdtype, mdtype, form, chunk, int(seed.removeprefix("s")))
    except ValueError as error:
        raise ValueError(f"not a memory-sweep case id: {case_id!r}") from error
    if case.id != case_id or not valid(case):
        raise ValueError(f"not a memory-sweep case id: {case_id!r}")
    return case


def valid(case: Case) -> bool:
    return (case.world in WORLDS and case.layout in layouts_for(case.world) and case.pdtype in PDTYPES
            and case.mdtype in MDTYPES and case.form in FORMS and case.chunk in CHUNKS and 0 <= case.seed < SHAPE_SEEDS)


def count(worlds: tuple[int, ...] = WORLDS) -> int:
    """How many cases there are."""
    return (sum(len(layouts_for(w)) for w in worlds) * len(PDTYPES) * len(MDTYPES) * len(FORMS) * len(CHUNKS)
            * SHAPE_SEEDS)


# ------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    kind: str  # "narrow" (rows of 1..130), "row" (1, n), "column" (n, 1), "wide", "stack" (3-D experts)
    frozen: bool  # never gets a grad


def _rows(draw: random.Random, world: int, width: int) -> int:
    rows = draw.choice([1, 2, 3, max(1, world - 1), world + 1, 7, 16, 33, 64, 100, 257, 1000, 4096])
    return max(1, min(rows, MAX_NUMEL // width))


def params_of(case: Case) -> list[Param]:
    """The case's Muon parameters, in the order the optimizer gets them (module docstring)."""
    draw = random.Random(f"memory-{case.seed}-P{case.world}")
    shapes: list[tuple[tuple[int, ...], str]] = []
    for _ in range(draw.choice((2, 3, 4))):
        width = draw.randint(NARROWEST, WIDEST_NARROW)
        shapes.append(((_rows(draw, case.world, width), width), "narrow"))
    if draw.random() < 0.5:
        shapes.append(((1, draw.choice([1, 2, 4, 5, 64, 127, 128, 129, 300, 1000, MAX_NUMEL])), "row"))
    if draw.random() < 0.5:
        shapes.append(((draw.choice([1, 2, 3, case.world + 1, 33, 500, 2048, MAX_NUMEL]), 1), "column"))
    if draw.random() < 0.5:
        width = draw.choice(WIDE)
        shapes.append(((_rows(draw, case.world, width), width), "wide"))
    if draw.random() < 0.5:
        width = draw.choice([draw.randint(NARROWEST, WIDEST_NARROW), draw.choice(WIDE)])
        experts = draw.choice([1, 2, 3, 4, 8])
        rows = max(1, min(draw.choice([1, 2, 4, 16]), MAX_NUMEL // (experts * width)))
        shapes.append(((experts, rows, width), "stack"))
    draw.shuffle(shapes)
    return [Param(f"p{i}", shape, kind, draw.random() < FROZEN_P) for i, (shape, kind) in enumerate(shapes)]


def row_length(shape: tuple[int, ...]) -> int:
    """The elements of one int8 row (the last dim: the models hold 2-D and 3-D tensors only)."""
    return shape[-1]


def narrow_widths(case: Case) -> set[int]:
    """The row widths in 1..130 of the case's parameters that get grads (a frozen one has no state)."""
    return {row_length(p.shape) for p in params_of(case) if row_length(p.shape) <= WIDEST_NARROW and not p.frozen}


def all_widths(cases: list[Case]) -> set[int]:
    """The row widths in 1..130 some case's parameters with a grad have."""
    return set().union(*(narrow_widths(c) for c in cases))


# ------------------------------------------------------------------------- the sample


def _draw(draw: random.Random, worlds: tuple[int, ...]) -> Case:
    world = draw.choice(worlds)
    return Case(world, draw.choice(layouts_for(world)), "bf16" if draw.random() < BF16_P else "fp32",
                draw.choice(MDTYPES), draw.choice(FORMS), draw.choice(list(CHUNKS)), draw.randrange(SHAPE_SEEDS))


def _config(case: Case) -> list[tuple[str, object]]:
    return [("world", case.world), ("layout", (case.world, case.layout)), ("pdtype", case.pdtype),
            ("mdtype", case.mdtype), ("form", case.form), ("chunk", case.chunk)]


def _model(case: Case) -> list[tuple[str, object]]:
    params = params_of(case)
    kinds = [("kind", p.kind) for p in params] + [("frozen", (case.world, case.layout)) for p in params if p.frozen]
    widths = narrow_widths(case)
    return [("width", w) for w in widths] + [("int8 width", w) for w in widths if case.mdtype == "int8"] + kinds


def sample(n: int, seed: int, worlds: tuple[int, ...] = WORLDS, candidates: int = 24) -> list[Case]:
    """``n`` distinct cases drawn by ``seed``, stratified: each pick is, of ``candidates``
    random cases, the one that adds the most (field, value) pairs not yet seen (each world
    size's layouts, both dtypes, each momentum dtype, form and chunk; every row width 1..130, each
    kind of parameter, frozen ones on each layout), then the most pairs of configuration
    fields not yet seen together; ties keep the first drawn."""
    draw = random.Random(seed)
    picked: list[Case] = []
    seen: set = set()
    singles: set = set()
    pairs: set = set()
    for _ in range(n):
        best, best_score = None, None
        for _ in range(candidates):
            case = _draw(draw, worlds)
            if case in seen:
                continue
            config = _config(case)
            score = (sum(f not in singles for f in config + _model(case)),
                     sum(p not in pairs for p in itertools.combinations(config, 2)))
            if best_score is None or score > best_score:
                best, best_score = case, score
        if best is None:
            break
        picked.append(best)
        seen.add(best)
        singles.update(_config(best) + _model(best))
        pairs.update(itertools.combinations(_config(best), 2))
    return picked
