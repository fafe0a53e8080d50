"""How many steps earlier one optimizer reaches another's loss: "leading steps".

Moonlight's Megatron proof of concept compares Muon with AdamW this way: for each step
``s`` of the AdamW (baseline) run, find the first step ``s'`` at which the Muon
(candidate) run's loss is at or below AdamW's loss at ``s``; the candidate leads by
``s - s'`` steps (negative: it trails). Per-step training losses are noisy, so both
curves are first smoothed with the same trailing moving average (the same lag on both
sides, so a shift between them is kept).

On a small corpus, the training loss also moves with *which* documents a step's batch
holds (the same batches for every run), so its smoothed curve is not monotone, and a
baseline loss that rises again is "reached" early by any run. Held-out validation loss,
measured on the same batches each time, has no such bumps:
``leading_steps_on_samples`` applies the same definition to curves sampled every few
steps (validation), interpolating between samples.

Pure Python on ``{step: loss}`` dicts (``titan_log.TitanLog.train_loss``/``val_loss``);
``scripts/study_report.py`` prints and plots the results, tests/test_leading_steps.py
specifies them on synthetic curves.
"""

from __future__ import annotations


def moving_average(losses: dict[int, float], window: int) -> dict[int, float]:
    """Trailing mean of each step's loss and the ``window - 1`` logged losses before it."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    steps = sorted(losses)
    out = {}
    for i, step in enumerate(steps):
        recent = [losses[s] for s in steps[max(0, i - window + 1): i + 1]]
        out[step] = sum(recent) / len(recent)
    return out


def first_step_reaching(losses: dict[int, float], target: float) -> int | None:
    """The first step whose loss is at or below ``target`` (``None`` if none is)."""
    return next((step for step in sorted(losses) if losses[step] <= target), None)


def leading_steps(baseline: dict[int, float], candidate: dict[int, float], window: int = 1) -> dict[int, int | None]:
    """For each baseline step ``s``: ``s`` minus the first candidate step reaching the
    baseline's (smoothed) loss at ``s``; ``None`` where the candidate never does."""
    base, cand = moving_average(baseline, window), moving_average(candidate, window)
    out: dict[int, int | None] = {}
    for step, target in base.items():
        reached = first_step_reaching(cand, target)
        out[step] = None if reached is None else step - reached
    return out


def steps_to_reach(losses: dict[int, float], target: float) -> tuple[int | None, float | None]:
    """When a curve sampled every few steps (validation) first gets to ``target``.

    Returns the first sampled step at or below ``target`` (an upper bound) and the step
    where the straight line between it and the sample before crosses ``target``
    (the estimate); ``(None, None)`` if no sample reaches it.
    """
    steps = sorted(losses)
    for i, step in enumerate(steps):
        if losses[step] <= target:
            if i == 0:
                return step, float(step)
            prev = steps[i - 1]
            fraction = (losses[prev] - target) / (losses[prev] - losses[step])
            return step, prev + fraction * (step - prev)
    return None, None


def leading_steps_on_samples(baseline: dict[int, float], candidate: dict[int, float]) -> dict[int, float | None]:
    """``leading_steps`` for sampled curves (validation): for each baseline sample step
    ``s``, ``s`` minus the interpolated step at which the candidate reaches the
    baseline's loss at ``s`` (``steps_to_reach``); ``None`` where it never does."""
    out: dict[int, float | None] = {}
    for step, target in sorted(baseline.items()):
        _, estimate = steps_to_reach(candidate, target)
        out[step] = None if estimate is None else step - estimate
    return out
