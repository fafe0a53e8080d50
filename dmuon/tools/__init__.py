"""The tools users run from the command line, above the runtime: nothing in the optimizer
imports them (``tests/test_layers.py``).

May import: everything in dmuon.

- ``plan_report``: what the fast path does at scale, from shapes alone
  (``python -m dmuon.tools.plan_report``);
- ``option_table``: the option table (``dmuon.options.table``) as docs/optimizer.md holds it
  (``python -m dmuon.tools.option_table --check`` / ``--write``);
- ``dry_run``: DMuon's CUDA step at real scale on fake CUDA tensors, without a GPU
  (``python -m dmuon.tools.dry_run``).

A public module (docs/development.md, "The public surface"): the tools' names and the
internals the benchmarks measure, importable from here (``from dmuon.tools import
newton_schulz_flops``). Each is imported when first asked for, so ``python -m
dmuon.tools.plan_report`` does not find its module imported by this package first.
"""

from __future__ import annotations

import importlib
from typing import Any

_NS = "dmuon.numerics.newton_schulz"
# Public name -> (module, its name there).
_EXPORTS: dict[str, tuple[str, str]] = {
    **{name: (_NS, name) for name in (
        "AUTO", "DEFAULT_NS_ALGORITHM", "DEFAULT_NS_DTYPE", "DEFAULT_NS_STEPS", "GRAM", "NS_ALGORITHMS", "NS_DTYPES",
        "NS_DTYPE_CHOICES", "STANDARD", "native_bf16_matmul", "newton_schulz_flops", "ns_dtype_name",
        "resolve_ns_algorithm", "resolve_ns_dtype")},
    **{name: ("dmuon.plan", name) for name in ("DEFAULT_BATCH_NUMEL", "OwnerPlan", "ParamSpec", "WIRE_BYTES",
                                                "make_owner_plan")},
    "chunk_ranges": ("dmuon.plan.layout", "chunk_ranges"),
    **{name: ("dmuon.numerics.momentum_storage", name) for name in ("dequantize_int8", "quantize_int8")},
    "DEFAULT_LOGIT_SCRATCH_BYTES": ("dmuon.attention.qk_clip", "DEFAULT_LOGIT_SCRATCH_BYTES"),
    "head_max_logits": ("dmuon.attention.qk_clip", "head_max_logits"),
    **{name: ("dmuon.torch_compat", name) for name in ("TorchDispatchMode", "compute_local_shape_and_global_offset",
                                                        "fake_store")},
    "LLAMA3_SHAPES": ("dmuon.tools.plan_report", "PRESETS"),
    "Llama3": ("dmuon.tools.plan_report", "Llama3"),
    "min_bytes_per_rank": ("dmuon.tools.plan_report", "min_bytes_per_rank"),
    "DRY_RUN_PRESETS": ("dmuon.tools.dry_run.models", "PRESETS"),
    "Preset": ("dmuon.tools.dry_run.models", "Preset"),
    "build": ("dmuon.tools.dry_run.models", "build"),
    "lay_out": ("dmuon.tools.dry_run.layouts", "lay_out"),
    "parse_layout": ("dmuon.tools.dry_run.layouts", "parse_layout"),
    "docs_table_main": ("dmuon.tools.option_table", "docs_table_main"),
    "marked_table": ("dmuon.tools.option_table", "marked_table"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dmuon.tools' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
