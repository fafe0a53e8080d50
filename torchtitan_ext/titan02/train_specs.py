"""Re-register TorchTitan's built-in model specs with DMuon support.

``torchtitan.protocols.train_spec.register_train_spec`` lets user-registered
specs take priority over built-ins under the same name. For every built-in
model (``llama3``, ``llama4``, ``qwen3``, ``deepseek_v3``, ``gpt_oss``,
``llama3_ft``, ``flux``) we register a copy of its ``TrainSpec`` in which

* ``build_optimizers_fn`` builds DMuon for ``[optimizer] name = "DMuon"`` and
  calls the original builder, untouched, for every other name;
* ``parallelize_fn`` goes through ``cpu_compat.wrap_parallelize_fn`` (identity on
  accelerators);
* ``build_tokenizer_fn`` first creates the embedded tokenizer when the job trains
  on the embedded ``pydoc`` dataset and ``hf_assets_path`` holds none yet;
* ``build_validator_fn`` rewinds the embedded validation split before each pass;
* ``build_metrics_processor_fn`` (when the spec has none of its own) adds DMuon's
  step figures to the step line and metric loggers (``metrics.py``).

``model.name`` in the TOML therefore stays ``"llama3"`` etc. Other specs (e.g.
TorchTitan's experiments) can be wrapped with ``with_dmuon(spec)`` and registered
under a new name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torchtitan.components.optimizer as tt_optimizer
from torchtitan.protocols.train_spec import register_train_spec, TrainSpec
from torchtitan.tools.logging import logger

from . import cpu_compat
from ..corpus import TRAIN_DATASET, VALIDATION_DATASET
from ..tokenizer import ensure_tokenizer
from ..versions import require_tested
from .config import DMUON_NAME
from .container import build_dmuon_optimizers
from .dataset import rewind_validation_before_each_run
from .metrics import build_dmuon_metrics_processor
from .validation import check_config_module_named


@contextlib.contextmanager
def _dmuon_as_torchtitan_builder() -> Iterator[None]:
    """Let builders that call TorchTitan's ``build_optimizers`` build DMuon instead.

    ``build_optimizers_with_moe_load_balancing`` (llama4, deepseek_v3, gpt_oss)
    builds its container through the module-level ``build_optimizers`` and then
    registers the MoE expert-bias hook on it; swapping that one name for the
    duration of the call keeps the MoE hook without copying TorchTitan's code.
    """
    require_tested("0.2", "torchtitan.components.optimizer.build_optimizers (for the MoE specs' builders)")
    saved = tt_optimizer.build_optimizers
    tt_optimizer.build_optimizers = build_dmuon_optimizers
    try:
        yield
    finally:
        tt_optimizer.build_optimizers = saved


def dmuon_aware_optimizer_builder(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` for every optimizer name except ``"DMuon"``."""

    @functools.wraps(original)
    def build_optimizers(model_parts, optimizer_config, parallel_dims, *args, **kwargs):
        if optimizer_config.name != DMUON_NAME:
            return original(model_parts, optimizer_config, parallel_dims, *args, **kwargs)
        check_config_module_named(SimpleNamespace(optimizer=optimizer_config))  # job.py's check missed it
        if original is tt_optimizer.build_optimizers:
            return build_dmuon_optimizers(model_parts, optimizer_config, parallel_dims, *args, **kwargs)
        with _dmuon_as_torchtitan_builder():
            return original(model_parts, optimizer_config, parallel_dims, *args, **kwargs)

    return build_optimizers


def _uses_embedded_data(job_config: Any) -> bool:
    return job_config.training.dataset == TRAIN_DATASET or (
        job_config.validation.enable and job_config.validation.dataset == VALIDATION_DATASET
    )


def _tokenizer_builder(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def build_tokenizer(job_config: Any, *args: Any, **kwargs: Any) -> Any:
        assets = job_config.model.hf_assets_path
        if _uses_embedded_data(job_config) and not (Path(assets) / "tokenizer.json").exists():
            ensure_tokenizer(assets)
        return original(job_config, *args, **kwargs)

    return build_tokenizer


def _validator_builder(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def build_validator(*args: Any, **kwargs: Any) -> Any:
        validator = original(*args, **kwargs)
        job_config = kwargs.get("job_config", args[0] if args else None)
        if job_config is not None and job_config.validation.dataset == VALIDATION_DATASET:
            validator = rewind_validation_before_each_run(validator)
        return validator

    return build_validator


def with_dmuon(spec: TrainSpec) -> TrainSpec:
    """A copy of ``spec`` with the wrappers described in the module docstring."""
    changes: dict[str, Any] = {
        "build_optimizers_fn": dmuon_aware_optimizer_builder(spec.build_optimizers_fn),
        "parallelize_fn": cpu_compat.wrap_parallelize_fn(spec.parallelize_fn),
    }
    if spec.build_tokenizer_fn is not None:
        changes["build_tokenizer_fn"] = _tokenizer_builder(spec.build_tokenizer_fn)
    if spec.build_validator_fn is not None:
        changes["build_validator_fn"] = _validator_builder(spec.build_validator_fn)
    if spec.build_metrics_processor_fn is None:  # a spec with its own processor keeps it
        changes["build_metrics_processor_fn"] = build_dmuon_metrics_processor
    return dataclasses.replace(spec, **changes)


def register_builtin_specs() -> list[str]:
    """Register ``with_dmuon`` copies of all built-in model specs; return their names."""
    from torchtitan.models import _supported_models

    registered = []
    for name in sorted(_supported_models):
        try:
            spec = importlib.import_module(f"torchtitan.models.{name}").get_train_spec()
        except ImportError as e:  # e.g. flux needs `transformers`; it cannot train anyway
            logger.debug(f"torchtitan_ext: model {name} not wrapped ({e})")
            continue
        try:
            register_train_spec(name, with_dmuon(spec))
        except ValueError:  # someone registered this name before us: keep theirs
            logger.warning(f"torchtitan_ext: TrainSpec {name!r} already registered; not wrapped")
            continue
        registered.append(name)
    return registered
