"""Bytes this rank sends in one optimizer step, counted the same way for every optimizer.

DistMuon and the other peers keep no counters of their own, and the profiler's record
of a collective has its input's shape but not its splits, so an uneven
``all_to_all_single`` (an owner exchange) would be miscounted from it. Instead,
:func:`count_sent` wraps ``torch.distributed``'s collectives while a step runs and
counts, per call:

- ``all_to_all_single``: the input's bytes less the split this rank keeps (exact);
- ``all_to_all``: the bytes of every input tensor but this rank's own (exact);
- ``all_reduce``: ``2 (P - 1) / P`` of the tensor (a ring, as ``benchmarks.bench``
  costs it);
- ``all_gather_into_tensor``, ``all_gather``: ``(P - 1)`` times the input (a ring);
- ``reduce_scatter_tensor``: ``(P - 1) / P`` of the input (a ring).

Only calls through these Python functions are seen: DTensor's functional collectives
(``redistribute``, ``full_tensor``) go to the backend directly and are not counted.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

COUNTED = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather_into_tensor", "all_gather",
           "reduce_scatter_tensor")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _rank_and_size(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def sent_by_call(op: str, call: inspect.BoundArguments) -> int:
    """The bytes this rank sends in one call of ``op`` (module docstring)."""
    args = call.arguments
    rank, size = _rank_and_size(args.get("group"))
    if op == "all_to_all_single":
        tensor, splits = args["input"], args.get("input_split_sizes")
        row = _nbytes(tensor) // max(tensor.shape[0], 1) if tensor.dim() else _nbytes(tensor)
        own = splits[rank] * row if splits else _nbytes(tensor) // size
        return _nbytes(tensor) - own
    if op == "all_to_all":
        return sum(_nbytes(t) for i, t in enumerate(args["input_tensor_list"]) if i != rank)
    if op == "all_reduce":
        return 2 * (size - 1) * _nbytes(args["tensor"]) // size
    if op == "all_gather_into_tensor":
        return (size - 1) * _nbytes(args["input_tensor"])
    if op == "all_gather":
        return (size - 1) * _nbytes(args["tensor"])
    if op == "reduce_scatter_tensor":
        return (size - 1) * _nbytes(args["input"]) // size
    raise ValueError(f"not a counted collective: {op!r}")


def _counting(op: str, original: Callable[..., Any], counts: Counter) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts[op] += sent_by_call(op, signature.bind(*args, **kwargs))
        return original(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def count_sent() -> Iterator[Counter]:
    """Bytes sent per collective (a ``Counter`` keyed by ``COUNTED`` names) by the calls
    made inside the block; ``torch.distributed`` is restored on exit."""
    counts: Counter = Counter()
    saved = {op: getattr(dist, op) for op in COUNTED}
    for op, original in saved.items():
        setattr(dist, op, _counting(op, original, counts))
    try:
        yield counts
    finally:
        for op, original in saved.items():
            setattr(dist, op, original)
