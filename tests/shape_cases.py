"""The shape sweep's cases (issue 60, item 1): a seeded generator of shapes, list orders,
dtypes, layouts and switches, each run on P gloo ranks against one process.

A case is one small model (its tensors drawn from ``seed``) under one configuration:

- ``world`` and ``layout``: P = 1, 2 or 4 and how each parameter is laid out
  (:data:`LAYOUTS`; the 2 x 2 meshes only at P = 4, the 1-D forms at every P);
- ``pdtype``: the parameters' dtype (fp32 or bf16);
- ``mdtype``: DMuon's ``momentum_dtype`` (``param``: None, ``bf16``, ``int8``);
- ``adtype``: DMuon's ``adamw_state_dtype`` (the same three), the AdamW part's moments: every
  model has an embedding-like matrix the default routing sends to AdamW (:func:`params_of`),
  laid out as the case's layout lays a matrix out, so its moments are kept in that form;
- ``form``: the implementation (``loop``: foreach=False, ``foreach``, ``fused``: foreach and
  fused AdamW as TorchTitan's ``implementation = "fused"`` maps it, ``capturable``);
- ``switches``: the update-rule options on (:data:`SWITCHES`; none: ``base``).

Its id spells every field (``P2-fsdp-fp32-int8-aint8-foreach-normuon.cwd-s17``; ``adtype``
after ``a``, left out where it is ``param``: ``P2-fsdp-fp32-int8-foreach-normuon.cwd-s17``), so
any failure reruns alone from the id (``python -m tests.shape_sweep --case ID``). The model
(:func:`params_of`) and each parameter's placements (:func:`placements_of`) are functions of
the case alone. Pure Python: no torch, so every rank (and the driver) builds the same
cases from the same seed.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

WORLDS = (1, 2, 4)
# Layouts per world size: the 1-D forms everywhere, the 2 x 2 meshes at P = 4.
LAYOUTS_1D = ("fsdp", "tp", "ep")
LAYOUTS_2D = ("hsdp", "fsdp_tp")
LAYOUTS = LAYOUTS_1D + LAYOUTS_2D
PDTYPES = ("fp32", "bf16")
MDTYPES = ("param", "bf16", "int8")
ADTYPES = MDTYPES  # adamw_state_dtype: None, bf16, int8
FORMS = ("loop", "foreach", "fused", "capturable")
# normuon: NorMuon; cwd: cautious weight decay; nonest: nesterov=False; nsbf16: Newton-Schulz
# in bf16 (the default here is float32: the same choice on every CPU).
SWITCHES = ("normuon", "cwd", "nonest", "nsbf16")
SHAPE_SEEDS = 1000
# The layout a case's DCP checkpoint is loaded into (at the same P): another cut of every tensor.
RESUME_LAYOUT = {
    1: {"fsdp": "tp", "tp": "ep", "ep": "fsdp"},
    2: {"fsdp": "tp", "tp": "ep", "ep": "fsdp"},
    4: {"fsdp": "fsdp_tp", "fsdp_tp": "tp", "tp": "hsdp", "hsdp": "ep", "ep": "fsdp"},
}
BLOCK = 128  # int8 momentum's block (elements of one row): widths on and off it
COLUMNS = (6, 7, 10, 64, 128, 129, 200, 256, 300)
MAX_NUMEL = 3000  # per tensor: a case runs in well under a second
# The row pieces the AdamW part steps kept moments in on the CPU (``dmuon.state.kept_state.
# CPU_PIECE_NUMEL``), by the case's seed (:func:`piece_numel`): the library's (a matrix here is
# one piece), one row a piece, or 200 elements (a few rows, cut at other rows on each rank
# than in the oracle).
PIECE_NUMELS = (None, 1, 200)


def piece_numel(case: "Case") -> int | None:
    """The AdamW part's row pieces for ``case`` (:data:`PIECE_NUMELS`; None: the library's)."""
    return PIECE_NUMELS[case.seed % len(PIECE_NUMELS)]


def layouts_for(world: int) -> tuple[str, ...]:
    return LAYOUTS if world == 4 else LAYOUTS_1D


@dataclass(frozen=True)
class Case:
    world: int
    layout: str
    pdtype: str
    mdtype: str
    form: str
    switches: tuple[str, ...]  # in SWITCHES' order
    seed: int
    adtype: str = "param"  # adamw_state_dtype

    @property
    def id(self) -> str:
        switches = ".".join(self.switches) or "base"
        adamw = "" if self.adtype == "param" else f"-a{self.adtype}"
        return (f"P{self.world}-{self.layout}-{self.pdtype}-{self.mdtype}{adamw}-{self.form}-{switches}"
                f"-s{self.seed}")

    @property
    def resume_layout(self) -> str:
        return RESUME_LAYOUT[self.world][self.layout]


def parse(case_id: str) -> Case:
    """The case an id names (the inverse of :attr:`Case.id`)."""
    try:
        fields = case_id.split("-")
        adtype = fields.pop(4).removeprefix("a") if len(fields) == 8 else "param"
        world, layout, pdtype, mdtype, form, switches, seed = fields
        case = Case(int(world.removeprefix("P")), layout, pdtype, mdtype, form,
                    () if switches == "base" else tuple(switches.split(".")), int(seed.removeprefix("s")), adtype)
    except ValueError as error:
        raise ValueError(f"not a shape-sweep case id: {case_id!r}") from error
    if case.id != case_id or not valid(case):
        raise ValueError(f"not a shape-sweep case id: {case_id!r}")
    return case


def valid(case: Case) -> bool:
    return (case.world in WORLDS and case.layout in layouts_for(case.world) and case.pdtype in PDTYPES
            and case.mdtype in MDTYPES and case.adtype in ADTYPES and case.form in FORMS
            and 0 <= case.seed < SHAPE_SEEDS
            and case.switches == tuple(s for s in SWITCHES if s in case.switches))


def _switch_sets() -> list[tuple[str, ...]]:
    return [tuple(s for s, on in zip(SWITCHES, bits) if on) for bits in itertools.product((0, 1), repeat=len(SWITCHES))]


def count(worlds: tuple[int, ...] = WORLDS) -> int:
    """How many cases :func:`all_cases` yields."""
    configs = sum(len(layouts_for(w)) for w in worlds)
    return configs * len(PDTYPES) * len(MDTYPES) * len(ADTYPES) * len(FORMS) * 2 ** len(SWITCHES) * SHAPE_SEEDS


def all_cases(worlds: tuple[int, ...] = WORLDS):
    """Every case the generator knows, in a fixed order (a generator: :func:`count` of them)."""
    for world in worlds:
        for layout, pdtype, mdtype, adtype, form, switches, seed in itertools.product(
                layouts_for(world), PDTYPES, MDTYPES, ADTYPES, FORMS, _switch_sets(), range(SHAPE_SEEDS)):
            yield Case(world, layout, pdtype, mdtype, form, switches, seed, adtype)


def _features(case: Case) -> list[tuple[str, object]]:
    """The (field, value) pairs a case covers: what the sample spreads over."""
    return [("world", case.world), ("layout", (case.world, case.layout)), ("pdtype", case.pdtype),
            ("mdtype", case.mdtype), ("adtype", case.adtype), ("form", case.form)] + [
                (s, s in case.switches) for s in SWITCHES]


def _embed_cut(case: Case) -> tuple[int, str, bool]:
    """Whether the case's layout cuts its AdamW matrix's rows, with P and the AdamW state
    dtype (under int8: kept in int8, or falling back to bf16)."""
    cut = any(cuts_rows(len(p.shape), placements_of(case, p)[1]) for p in params_of(case) if p.kind == "embed")
    return case.world, case.adtype, cut


def _draw(draw: random.Random, worlds: tuple[int, ...]) -> Case:
    world = draw.choice(worlds)
    switches = tuple(s for s in SWITCHES if draw.random() < 0.5)
    return Case(world, draw.choice(layouts_for(world)), draw.choice(PDTYPES), draw.choice(MDTYPES),
                draw.choice(FORMS), switches, draw.randrange(SHAPE_SEEDS), draw.choice(ADTYPES))


def sample(n: int, seed: int, worlds: tuple[int, ...] = WORLDS, candidates: int = 24) -> list[Case]:
    """``n`` distinct cases drawn by ``seed``, stratified: each pick is, of ``candidates``
    random cases, the one that adds the most (field, value) pairs not yet seen (every world
    size's layouts, dtypes, momentum and AdamW state dtypes, forms, each switch on and off),
    then an AdamW matrix cut or not not yet seen (:func:`_embed_cut`), then the most pairs of
    them (pairwise coverage); ties keep the first drawn."""
    draw = random.Random(seed)
    picked: list[Case] = []
    seen: set = set()
    singles: set = set()
    cuts: set = set()
    pairs: set = set()
    for _ in range(n):
        best, best_score = None, None
        for _ in range(candidates):
            case = _draw(draw, worlds)
            if case in seen:
                continue
            feats = _features(case)
            new_single = sum(f not in singles for f in feats)
            new_pairs = sum(p not in pairs for p in itertools.combinations(feats, 2))
            score = (new_single, _embed_cut(case) not in cuts, new_pairs)
            if best_score is None or score > best_score:
                best, best_score = case, score
        if best is None:
            break
        picked.append(best)
        seen.add(best)
        feats = _features(best)
        singles.update(feats)
        cuts.add(_embed_cut(best))
        pairs.update(itertools.combinations(feats, 2))
    return picked


# ------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix", "stack" (3-D experts), "conv" (4-D), "vector" (1-D: AdamW), "embed" (2-D: AdamW)

    @property
    def adamw(self) -> bool:
        """Whether DMuon's default routing sends it to the AdamW part (a vector; a matrix named
        as an embedding: ``embed.*``)."""
        return self.kind in ("vector", "embed")


# An embedding-like matrix's widths: below int8's narrowest row (bf16 on any layout), on and
# off the 128-element blocks.
EMBED_COLUMNS = (3, 6, 10, 64, 128, 129, 200, 256)


def _matrix(draw: random.Random, world: int) -> tuple[int, int]:
    rows = draw.choice([1, 2, 3, max(1, world - 1), world + 1, 2 * world + 1, 5, 9, 16, 33])
    cols = draw.choice(COLUMNS)
    return min(rows, max(1, MAX_NUMEL // cols)), cols


def params_of(case: Case) -> list[Param]:
    """The case's parameters, in the order the optimizer gets them: 2-3 matrices (rows from 1
    to above P: empty shards; columns on and off the 128-element blocks), often a transposed
    pair ``(a, b)`` and ``(b, a)``, a 3-D expert stack, often a 4-D conv-like weight
    ``(O, C, kh, kw)``, and for the AdamW part 1-2 vectors and an embedding-like matrix (named
    ``embed.*``: the default routing's AdamW; rows from 1 to above P, widths from 3 to 256),
    shuffled. A function of the seed and P alone (the same model under every layout and option)."""
    draw = random.Random(f"shapes-{case.seed}-P{case.world}")
    shapes: list[tuple[tuple[int, ...], str]] = [(_matrix(draw, case.world), "matrix")
                                                  for _ in range(draw.choice((1, 2, 3)))]
    if draw.random() < 0.6:
        a, b = draw.choice([1, 2, 3, 5, 7, case.world + 1]), draw.choice((7, 10, 129, 200, 256))
        shapes += [((a, b), "matrix"), ((b, a), "matrix")]
    experts = draw.choice([1, 2, 3, 4, 5, 8])
    rows, cols = draw.choice([1, 2, 4, 6]), draw.choice((6, 7, 64, 128, 129, 140))
    shapes.append(((experts, rows, min(cols, max(1, MAX_NUMEL // (experts * rows)))), "stack"))
    if draw.random() < 0.6:
        kh, kw = draw.choice([(1, 1), (3, 3), (5, 5), (3, 1)])
        channels = draw.choice([1, 2, 3, 4, 16])
        outputs = min(draw.choice([1, 2, 3, 5, 8]), MAX_NUMEL // (channels * kh * kw))
        shapes.append(((outputs, channels, kh, kw), "conv"))
    for _ in range(draw.choice((1, 2))):
        shapes.append(((draw.choice([1, 3, case.world + 1, 12, 130]),), "vector"))
    embed = random.Random(f"embed-{case.seed}-P{case.world}")  # apart: the other shapes drawn as before
    cols = embed.choice(EMBED_COLUMNS)
    rows = embed.choice([1, 2, max(1, case.world - 1), case.world + 1, 5, 9, 16, 33])
    shapes.append(((min(rows, max(1, MAX_NUMEL // cols)), cols), "embed"))
    draw.shuffle(shapes)
    return [Param(f"embed.p{i}" if kind == "embed" else f"p{i}", shape, kind)
            for i, (shape, kind) in enumerate(shapes)]


# ------------------------------------------------------------------------- the layouts

# A placement spec: "R" Replicate, "S<d>" Shard(d), "SS<d>" _StridedShard(d, split_factor=2);
# a mesh: "world" (1-D, every rank) or "grid" (2 x 2).


def placements_of(case: Case, param: Param, layout: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(mesh, placement specs) of ``param`` under ``layout`` (the case's by default), as
    TorchTitan lays such tensors out; a choice between a column- and a row-wise cut is drawn
    from the seed and the parameter's name."""
    layout = layout or case.layout
    ndim = len(param.shape)
    pick = random.Random(f"cut-{case.seed}-{param.name}-{layout}").choice
    grid = case.world == 4
    if layout == "fsdp":
        return "world", ("S0",)
    if layout == "hsdp":
        return "grid", ("R", "S0")
    if layout == "tp":  # column- or row-wise; vectors replicated; on a 2 x 2 mesh under data parallel
        cut = "R" if ndim == 1 else pick({2: ("S0", "S1"), 3: ("S1", "S2"), 4: ("S0", "S1")}[ndim])
        return ("grid", ("R", cut)) if grid else ("world", (cut,))
    if layout == "fsdp_tp":  # FSDP on the first dim of the mesh, TP on the second
        if ndim == 1:
            return "grid", ("S0", "R")
        if ndim == 3:
            return "grid", ("S0", pick(("S1", "S2")))
        return "grid", pick((("SS0", "S0"), ("S0", "S1")))
    if layout == "ep":  # expert stacks cut by expert; the rest FSDP over every rank
        if param.kind == "stack" and grid:  # (efsdp, ep): FSDP cuts dim 1 when efsdp * ep > E
            return "grid", ("SS0", "S0") if param.shape[0] >= case.world else ("S1", "S0")
        return "world", ("S0",)
    raise ValueError(f"unknown layout {layout!r}")


def cuts_rows(ndim: int, specs: tuple[str, ...]) -> bool:
    """Whether the specs cut an ``ndim``-D tensor's int8 rows (the last dim; for a 4-D
    weight, whose rows are ``[O, C*kh*kw]``'s, any dim but the first)."""
    dims = {int(s.lstrip("S")) for s in specs if s != "R"}
    return any(d != 0 for d in dims) if ndim > 3 else (ndim - 1) in dims


def row_length(shape: tuple[int, ...]) -> int:
    """The elements of one int8 row: the last dim (a 3-D stack's per expert), ``C*kh*kw`` for 4-D."""
    return math.prod(shape[1:]) if len(shape) > 3 else shape[-1]


def rows_of(shape: tuple[int, ...]) -> int:
    return shape[0] if len(shape) > 3 else math.prod(shape[:-1])
