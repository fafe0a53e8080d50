"""Generated shapes, list orders, dtypes, layouts and switches (issue 60, item 1): a fixed
sample of ``tests.shape_cases`` run on 1, 2 and 4 gloo ranks by ``tests.shape_sweep``, each
case held against every check (no exception on any rank; weights and state bitwise one
process's, the AdamW part's moments in the case's ``adamw_state_dtype`` included; nothing alive
after the step but parameters and state, and the momentum and AdamW moments their documented
size; a DCP checkpoint resumed under another layout steps on as the uninterrupted run). Any
number more: ``python -m tests.shape_sweep --cases N --seed S``; a failure's id reruns it alone.

The generator's own rules are unit tests here too: ids that name their case, a sample that
covers every layout, dtype, momentum dtype, AdamW state dtype and implementation form, and
models with empty shards, widths on and off the int8 blocks, transposed pairs, 3-D stacks,
4-D weights and an AdamW matrix (kept in int8 on sharded layouts in the sample)."""

from __future__ import annotations

import itertools
import math
import time

import pytest

from tests.shape_cases import (ADTYPES, BLOCK, FORMS, MDTYPES, PDTYPES, SWITCHES, all_cases, count, layouts_for,
                               params_of, parse, placements_of, sample)
from tests.shape_sweep import Result, summary, sweep

# The CI sample, stratified per world size (every layout, dtype, momentum dtype, AdamW state
# dtype, form and switch comes up at each P). A case takes about 0.7 s at P = 1, 1 s at P = 2 and 1.8 s at
# P = 4 on 2 cores, a launch 3 to 6 s more: about 100 s in all. On broken code the sweep
# stops after MAX_FAILED failed cases.
SAMPLE = {1: (12, 60), 2: (24, 60), 4: (24, 60)}  # P -> (cases, seed)
MAX_FAILED = 8


class Sweeps:
    """The sample, swept once per world size when a test first asks (one launch of P ranks
    for all its cases; a case that breaks its launch ends it, the rest run in a new one)."""

    def __init__(self) -> None:
        self.results: dict[str, Result] = {}
        self.summaries: dict[int, str] = {}

    def check(self, world: int) -> None:
        cases = sample(*SAMPLE[world], (world,))
        if world not in self.summaries:
            start = time.perf_counter()
            results = sweep(cases, per_launch=len(cases), log=lambda *a, **k: None, max_failed=MAX_FAILED)
            self.results.update((r.case.id, r) for r in results)
            self.summaries[world] = summary(results, time.perf_counter() - start)
        text = self.summaries[world]
        assert all(c.id in self.results for c in cases), f"cases never ran (the sweep stopped early):\n{text}"
        assert not any(self.results[c.id].failures for c in cases), text


@pytest.fixture(scope="module")
def sweeps() -> Sweeps:
    return Sweeps()


@pytest.mark.multirank
@pytest.mark.parametrize("world", sorted(SAMPLE), ids=lambda p: f"P{p}")
def test_generated_shapes_and_switches_equal_one_process_on_every_layout(sweeps, world):
    sweeps.check(world)


# ------------------------------------------------------------------------- the generator


def _ci_cases():
    return [c for world, (n, seed) in SAMPLE.items() for c in sample(n, seed, (world,))]


@pytest.mark.unit
def test_a_case_id_names_its_case():
    for case in itertools.islice(all_cases(), 0, 200_000, 997):
        assert parse(case.id) == case
    for case in sample(200, 3):
        assert parse(case.id) == case
    assert parse("P2-fsdp-fp32-int8-foreach-normuon.cwd-s17").switches == ("normuon", "cwd")
    assert parse("P2-fsdp-fp32-int8-foreach-normuon.cwd-s17").adtype == "param"
    assert parse("P2-fsdp-fp32-param-aint8-foreach-base-s17").adtype == "int8"
    for bad in ("P2-fsdp-fp32-int8-foreach-cwd.normuon-s17", "P2-hsdp-fp32-int8-foreach-base-s1",
                "P3-fsdp-fp32-int8-foreach-base-s1", "P2-fsdp-fp32-int8-foreach-base-s01", "P2-fsdp-fp32",
                "P2-fsdp-fp32-int8-aparam-foreach-base-s1", "P2-fsdp-fp32-int8-afp8-foreach-base-s1",
                "P2-fsdp-fp32-int8-int8-foreach-base-s1"):
        with pytest.raises(ValueError):
            parse(bad)
    assert count() > 1_000_000


@pytest.mark.unit
def test_the_sample_is_seeded_and_covers_every_layout_dtype_momentum_and_adamw_state_dtype_and_form():
    assert sample(30, 7) == sample(30, 7)
    assert sample(30, 7) != sample(30, 8)
    assert len(set(sample(300, 1))) == 300
    for world, (n, seed) in SAMPLE.items():
        cases = sample(n, seed, (world,))
        assert {c.layout for c in cases} == set(layouts_for(world))
        assert {c.pdtype for c in cases} == set(PDTYPES)
        assert {c.mdtype for c in cases} == set(MDTYPES)
        assert {c.adtype for c in cases} == set(ADTYPES)
        assert {c.form for c in cases} == set(FORMS)
        for switch in SWITCHES:
            assert {switch in c.switches for c in cases} == {True, False}
    # A small sample over every P already covers each world size's layouts.
    assert {(c.world, c.layout) for c in sample(11, 0)} == {(w, lay) for w in (1, 2, 4) for lay in layouts_for(w)}


@pytest.mark.unit
def test_the_models_have_empty_shards_off_block_widths_transposed_pairs_stacks_and_conv_weights():
    found = set()
    for case in _ci_cases():
        params = params_of(case)
        shapes = [p.shape for p in params]
        assert len({p.name for p in params}) == len(params)
        assert all(math.prod(s) <= 3000 for s in shapes)
        assert any(p.kind == "vector" for p in params)  # the AdamW part
        assert any(p.kind == "embed" and len(p.shape) == 2 and p.adamw for p in params)  # its matrix
        assert any(p.kind == "stack" for p in params)  # EP has something to cut
        matrices = [s for s in shapes if len(s) == 2]
        if any((b, a) in matrices for a, b in matrices if a != b):
            found.add("transposed pair")
        if any(p.kind == "conv" for p in params):
            found.add("4-D")
        for p in params:
            _, specs = placements_of(case, p)
            if case.world > 1 and specs[-1] == "S0" and p.shape[0] < case.world:
                found.add("empty shard")
            if len(p.shape) in (2, 3):
                found.add("off-block width" if p.shape[-1] % BLOCK else "on-block width")
                if p.shape[-1] > BLOCK and p.shape[-1] % BLOCK:
                    found.add("a full block and a short one")
        if params != sorted(params, key=lambda p: len(p.shape)):
            found.add("mixed order")
    assert found == {"transposed pair", "4-D", "empty shard", "off-block width", "on-block width",
                     "a full block and a short one", "mixed order"}


@pytest.mark.unit
def test_int8_momentum_falls_back_to_bf16_exactly_where_a_cut_splits_the_blocks():
    from tests.shape_cases import Case, Param
    from tests.shape_runner import falls_back

    case = Case(2, "tp", "fp32", "int8", "loop", (), 0)
    assert not falls_back(case, Param("x", (6, 256), "matrix"), "fsdp")  # whole rows
    assert falls_back(case, Param("x", (6, 8, 3, 3), "conv"), "fsdp") is False
    rowwise = [p for p in (Param(f"p{i}", (6, 256), "matrix") for i in range(40))
               if placements_of(case, p)[1] == ("S1",)]
    assert rowwise and not falls_back(case, rowwise[0])  # 128 columns a rank: on the blocks
    narrow = [p for p in (Param(f"p{i}", (6, 200), "matrix") for i in range(40)) if placements_of(case, p)[1] == ("S1",)]
    assert narrow and falls_back(case, narrow[0])  # 100 columns a rank
    convs = [p for p in (Param(f"p{i}", (4, 2, 3, 3), "conv") for i in range(40)) if placements_of(case, p)[1] == ("S1",)]
    assert convs and falls_back(case, convs[0])  # a cut inside [O, C*kh*kw]'s rows


@pytest.mark.unit
def test_the_sample_keeps_adamw_matrices_in_int8_on_sharded_layouts_and_in_bf16_where_they_fall_back():
    # int8 AdamW moments are compared bit for bit with one process's on at least two sharded
    # layouts at each P > 1, and the fallback (a cut inside the blocks) comes up too.
    from tests.shape_runner import fallbacks

    for world, (n, seed) in SAMPLE.items():
        kept, fell = set(), set()
        for case in (c for c in sample(n, seed, (world,)) if c.adtype == "int8"):
            _, bf16 = fallbacks(case)
            for p in params_of(case):
                if p.kind == "embed":
                    (fell if p.name in bf16 else kept).add(case.layout if world > 1 else "any")
        assert kept, f"P{world}: no AdamW matrix kept in int8"
        if world > 1:
            assert fell and len(kept) >= 2, (world, kept, fell)
