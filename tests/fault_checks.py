"""The fault sweep's checks: one case's observations (every rank's, from
``tests.fault_runner``) held against the contract of issue 40 (``tests.fault_cases``).

Each check returns the failures it finds as ``(item, text)``, ``item`` the contract's
number (1 no hang, 2 the same collectives, 3 the outcome, 4 nothing changed by a raising
step, 5 usable and equal to one process afterwards, 6 plain tensors), so a sweep's
summary says which promise broke. Every check reads only what the ranks recorded; none
trusts the optimizer's own account of itself.
"""

from __future__ import annotations

from typing import Any

from tests.fault_cases import (
    AGREED_ERROR,
    DISAGREE_ERROR,
    LOCAL_ERROR,
    Case,
    Expected,
    expected,
)
from tests.fault_model import PLAIN
from tests.fault_runner import per_group

Failure = tuple[int, str]
ERROR_PREFIXES = ("ValueError: DMuon: ", "RuntimeError: DMuon: ")


def check_case(case: Case, ranks: list[dict[str, Any]]) -> list[Failure]:
    """Every failure of one case whose observations came back from every rank."""
    broken = [(0, f"rank {r}: harness error: {o['harness_error']}") for r, o in enumerate(ranks) if "harness_error" in o]
    if broken:
        return broken
    failures = check_collectives(case, ranks)
    for scope in sorted({expected(case, r).scope for r in range(case.world)}):
        want = expected(case, scope[0])
        mode = outcome_mode(want)
        failures += check_outcomes(case, want, mode, ranks)
        failures += check_unchanged(case, want, mode, ranks)
        failures += check_reference(case, want, mode, ranks)
    return failures


# ------------------------------------------------------------------ item 2


def check_collectives(case: Case, ranks: list[dict[str, Any]]) -> list[Failure]:
    """Per step, every group's collectives alike on its ranks; step ``k`` on each rank the
    same as the clean twin's step ``k`` (op, dtypes, sizes, group ranks): a placement fault
    too, since a replicated parameter's grad is summed by the plan's collectives, whatever
    its placement.

    Compared: the ops as dispatched to the backend (``c10d``/``_c10d_functional``, each with
    its real gloo group). The profiler's ``gloo:*`` events are recorded too but not compared:
    gloo runs a collective on its own threads, so one started asynchronously near the end of
    a step (telemetry's) may land after the profiler stops."""
    failures = []
    for step in range(len(ranks[0]["seq"])):
        seen: dict[str, tuple[int, list]] = {}
        for r, obs in enumerate(ranks):
            for group, ops in per_group(obs["seq"][step] if step < len(obs["seq"]) else None).items():
                first = seen.setdefault(group, (r, ops))
                if first[1] != ops:
                    failures.append((2, f"step {step}: ranks {first[0]} and {r} ran different collectives on "
                                        f"group {group}: {_short(first[1])} vs {_short(ops)}"))
    for r, obs in enumerate(ranks):
        mine, clean = obs["seq"][case.k] or {}, obs["twin"][case.k] or {}
        for what in ("groups",):  # the profiler's gloo events run on gloo's threads: racy at a step's end
            if mine.get(what) != clean.get(what):
                failures.append((2, f"rank {r}: step {case.k} ({what}) differs from a clean step: "
                                    + first_difference(mine.get(what) or [], clean.get(what) or [])))
    return failures


def first_difference(mine: list, clean: list) -> str:
    """Where two collective sequences part: the index and both entries there."""
    index = next((i for i, (a, b) in enumerate(zip(mine, clean)) if a != b), min(len(mine), len(clean)))
    at = (lambda seq: _short(seq[index], 160) if index < len(seq) else "nothing")
    return f"{len(mine)} vs {len(clean)} collectives; #{index}: {at(mine)} vs clean {at(clean)}"


def _short(value: Any, limit: int = 300) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------ item 3


def outcome_mode(want: Expected) -> str:
    """The outcome the contract fixes, ``"error"`` for ``"local_error_or_agreed"``."""
    return "error" if want.outcome == "local_error_or_agreed" else want.outcome


def expected_texts(case: Case, want: Expected, mode: str, rank: int) -> dict[int, tuple[str, ...] | None]:
    """Per step in ``k``, ``k + 1``: the prefixes allowed (None: must return normally)."""
    local = LOCAL_ERROR.format(name=case.target)
    faulty = rank in want.faulty
    if mode == "local_error":
        return {case.k: (local,) if faulty else None, case.k + 1: (AGREED_ERROR.format(n=len(want.faulty)),)}
    if mode == "disagree":
        return {case.k: None, case.k + 1: (DISAGREE_ERROR,)}
    if mode == "error":  # step k: None or the local error (check_outcomes allows both)
        return {case.k: (local,), case.k + 1: ERROR_PREFIXES}
    return {case.k: None, case.k + 1: None}


def check_outcomes(case: Case, want: Expected, mode: str, ranks: list[dict[str, Any]]) -> list[Failure]:
    """Who raises what, when (item 3), the same text on every rank of the DMuon at the
    step after the fault, and clean steps after it (item 5)."""
    failures = []
    if mode == "qk":
        return check_qk_outcomes(case, want, ranks)
    for r in want.scope:
        outcomes = ranks[r]["outcomes"]
        allowed = expected_texts(case, want, mode, r)
        for step, got in enumerate(outcomes):
            prefixes = allowed.get(step)
            if mode == "error" and step == case.k:
                ok = got is None or got.startswith(LOCAL_ERROR.format(name=case.target))
            else:
                ok = got is None if prefixes is None else (got is not None and got.startswith(prefixes))
            if not ok:
                item = 5 if step > case.k + 1 else 3
                failures.append((item, f"rank {r}: step {step} ({_role(case, step)}): got {_short(got, 200)}; "
                                       f"expected {_expectation(prefixes, mode, step, case)}"))
    texts = {ranks[r]["outcomes"][case.k + 1] for r in want.scope}
    if len(texts) > 1 and mode in ("local_error", "disagree", "error"):
        failures.append((3, f"ranks {list(want.scope)} raised different errors at step {case.k + 1}: "
                            + " | ".join(_short(t, 120) for t in texts)))
    if mode == "disagree" and all(t and repr(case.target) not in t for t in texts):
        failures.append((3, f"the disagreement error does not name {case.target!r}"))
    return failures


def _role(case: Case, step: int) -> str:
    return {case.k: "the faulty step", case.k + 1: "the step after"}.get(step, "a clean step")


def _expectation(prefixes: tuple[str, ...] | None, mode: str, step: int, case: Case) -> str:
    if mode == "error" and step == case.k:
        return f"None or {LOCAL_ERROR.format(name=case.target)!r}..."
    return "no error" if prefixes is None else " or ".join(repr(p + "...") for p in prefixes)


def check_qk_outcomes(case: Case, want: Expected, ranks: list[dict[str, Any]]) -> list[Failure]:
    """An attention that never reports: every rank raises the same DMuon error at the same
    step (``k`` or ``k + 1``), as one process does, and no other step raises."""
    raising = {r: [s for s, o in enumerate(ranks[r]["outcomes"]) if o is not None] for r in want.scope}
    texts = {ranks[r]["outcomes"][s] for r, steps in raising.items() for s in steps}
    failures = []
    steps = {tuple(s) for s in raising.values()}
    if len(steps) != 1 or len(texts) != 1:
        failures.append((3, f"the ranks raised at different steps or with different texts: {raising}, "
                            + " | ".join(_short(t, 120) for t in texts)))
    (first,) = steps if len(steps) == 1 else ((),)
    if len(first) != 1 or first[0] not in (case.k, case.k + 1):
        failures.append((3, f"a missing QK-clip report must raise once, at step {case.k} or {case.k + 1}, "
                            f"on every rank: raised at {sorted(first)}"))
    elif not next(iter(texts)).startswith(ERROR_PREFIXES):
        failures.append((3, f"not a DMuon error: {_short(next(iter(texts)), 200)}"))
    reference = ranks[want.scope[0]]["reference"].get("all", {}).get("outcomes", [])
    ref_steps = [s for s, o in enumerate(reference) if o is not None]
    if list(first) != ref_steps:
        failures.append((3, f"raised at steps {list(first)}; one process raises at {ref_steps}"))
    return failures


# ------------------------------------------------------------------ item 4


def check_unchanged(case: Case, want: Expected, mode: str, ranks: list[dict[str, Any]]) -> list[Failure]:
    """A raising (or skipped) step changes nothing on any rank: for an agreed error, nothing differs
    between before step ``k`` and after step ``k + 1`` (step ``k`` masked on every rank
    too); for QK-clip, nothing differs across the step that raised."""
    if mode not in ("local_error", "disagree", "error", "qk", "skipped"):
        return []
    failures = []
    for r in want.scope:
        if mode == "skipped":  # no error, step k changed nothing, and it counts as one skipped step
            moved = ranks[r]["changed"]["by_k"]
            if ranks[r]["skipped_steps"] != 1:
                failures.append((4, f"rank {r}: counted {ranks[r]['skipped_steps']} skipped steps; one was skipped"))
        elif mode == "qk":
            raised = [s for s in (case.k, case.k + 1) if ranks[r]["outcomes"][s] is not None]
            moved = ranks[r]["changed"]["by_k" if raised[:1] == [case.k] else "by_k1"] if raised else []
        else:
            moved = ranks[r]["changed"]["over_k_k1"]
        if moved:
            what = "step" if mode == "skipped" else "the error"
            failures.append((4, f"rank {r}: changed between before step {case.k} and {what}: {_short(moved, 200)}"))
            if any(key.split("/")[0] in PLAIN for key in moved):
                failures.append((6, f"rank {r}: plain tensors changed in a masked step: "
                                    f"{sorted({k.split('/')[0] for k in moved} & PLAIN)}"))
    return failures


# ------------------------------------------------------------------ item 5


def check_reference(case: Case, want: Expected, mode: str, ranks: list[dict[str, Any]]) -> list[Failure]:
    """After the clean steps, every rank's parameters (and state keys) are one process's:
    every step on this rank's grads for a fault that is no error, the clean steps only for
    one that is."""
    variant = "all" if mode in ("clean", "valid", "qk") else "skip_k" if mode == "skipped" else "skip"
    failures = []
    for r in want.scope:
        reference = ranks[r]["reference"].get(variant)
        if reference is None:
            failures.append((0, f"rank {r}: no {variant!r} reference was run"))
            continue
        if reference["differ"]:
            plain = mode == "valid" and case.where.startswith("plain")
            failures.append((6 if plain else 5, f"rank {r}: differs from one process ({variant}): "
                                                f"{_short(reference['differ'], 200)}"))
    return failures
