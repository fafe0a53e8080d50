"""A curated mutation suite over dmuon's guarantees (issue 52): ``python -m tests.mutants``.

Each :class:`Mutant` is one small, plausible bug in code a documented guarantee rests on:
a text replacement in one file (``old`` must occur exactly once there), the guarantee it
breaks, and the tests that must fail when it is planted. The runner (``__main__``) plants
each in a scratch copy of the repository, runs its tests there, and reports it killed (the
tests failed or timed out) or survived, with the time and the first failing test.
``tests/test_mutants.py`` keeps the catalogue in step with the code: every ``old`` still
occurs once, every named test file exists.

How to add one with a new guarantee (docs/development.md, "The mutation suite"): write the
bug you fear as ``old`` -> ``new``, name the guarantee and the tests that claim it, run
``python -m tests.mutants --only NAME`` and watch it killed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    """Short, unique, kebab-case: what the bug does."""
    guarantee: str
    """The documented guarantee it breaks, in words."""
    path: str
    """The file it changes, relative to the repository root."""
    old: str
    """Text that occurs exactly once in ``path``."""
    new: str
    """What replaces it: the bug."""
    tests: tuple[str, ...]
    """pytest arguments selecting the tests that must kill it (node ids, files, ``-k`` ...)."""
    timeout_s: int = 300
    """How long its tests may run before the run counts as a hang (a kill: the suite noticed)."""


def catalogue() -> list[Mutant]:
    """Every mutant, in the order the runner takes them."""
    from tests.mutants.catalog_core import CORE
    from tests.mutants.catalog_wide import WIDE
    from tests.mutants.catalog_edges import EDGES

    return [*CORE, *WIDE, *EDGES]
