"""Running ``python -m dmuon.tools.dry_run`` from a test: the skip mark for a CPU-only torch
build (the dry runs need a CUDA build: CI's torch 2.15 leg) and the ranks' reports of a
command line."""

from __future__ import annotations

import pytest
import torch

from dmuon.tools.dry_run.__main__ import make_config, parse_args, run_configs, run_ranks

needs_cuda_build = pytest.mark.skipif(torch.version.cuda is None,
                                      reason="the dry run needs a CUDA build of torch (CI's torch 2.15 leg)")
# A dry-run rule checked again on another layout, size or option (marked ``dry_run_sweep``):
# torch 2.15's leg runs every one; the torch 2.11 leg runs each rule once, on its first case
# (``-m "... and not dry_run_sweep"``, scripts/test_torch211.sh): what can change from one
# torch release to the next is the fake CUDA machinery and torch's ops, which the first case
# already exercises; the layouts and sizes are dmuon's own logic (docs/development.md).
dry_run_sweep = pytest.mark.dry_run_sweep


def sweep(*values, first_of_rule: bool = False):
    """A ``pytest.param`` of ``values`` marked ``dry_run_sweep`` unless it is the rule's first case."""
    return pytest.param(*values, marks=() if first_of_rule else dry_run_sweep)


def dry_run(*argv: str):
    """The reports of the ranks ``argv`` names (CLI arguments)."""
    config, ranks = make_config(parse_args(list(argv)))
    return run_ranks(config, ranks, jobs=2)


def dry_runs(*argvs: tuple[str, ...]):
    """The reports of several command lines (CLI arguments each), every rank of every one in one
    pool of two processes: per command line, the list of its ranks' reports."""
    configs = [make_config(parse_args(list(argv))) for argv in argvs]
    reports = iter(run_configs([(config, rank) for config, ranks in configs for rank in ranks], jobs=2))
    return [[next(reports) for _ in ranks] for _, ranks in configs]
