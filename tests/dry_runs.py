"""Running ``python -m dmuon.dry_run`` from a test: the skip mark for a CPU-only torch
build (the dry runs need a CUDA build: CI's torch 2.15 leg) and the ranks' reports of a
command line."""

from __future__ import annotations

import pytest
import torch

from dmuon.dry_run.__main__ import make_config, parse_args, run_ranks

needs_cuda_build = pytest.mark.skipif(torch.version.cuda is None,
                                      reason="the dry run needs a CUDA build of torch (CI's torch 2.15 leg)")


def dry_run(*argv: str):
    """The reports of the ranks ``argv`` names (CLI arguments)."""
    config, ranks = make_config(parse_args(list(argv)))
    return run_ranks(config, ranks, jobs=2)
