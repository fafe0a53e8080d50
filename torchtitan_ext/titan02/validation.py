"""The parse-time checks of DMuon's ``[optimizer]`` fields, and where TorchTitan runs them.

``validate_optimizer_config`` rejects bad values with the error ``DMuon(...)``
gives (the same validator, with ``[optimizer]`` where DMuon says ``DMuon``);
``install_config_validation`` makes TorchTitan's ``ConfigManager`` call it
right after parsing, i.e. before any process group or model exists.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from typing import Any

from dmuon.options import check_group, check_optimizer_options, split_options

from ..field_checks import check_flag, check_number, Interval, NON_NEGATIVE, UNIT
from ..versions import require_tested
from .config import DMUON_NAME
from .kwargs import dmuon_kwargs, TOML_CHOICES

# What [experimental] custom_import names: importing it installs the job half (job.py).
JOB_MODULE = "torchtitan_ext.titan02.job"
# What dmuon's messages name this front end by (DMuon's own say "DMuon").
WHERE = "[optimizer]"
# The [optimizer] fields dmuon's validator would report under DMuon's keyword (the AdamW
# part's ``lr`` for adamw_lr, ``betas`` for beta1 / beta2): checked first, as written, with
# where each may lie. Every other number is dmuon's to check (the same message as DMuon(...)).
NUMBER_FIELDS: dict[str, Interval] = {"adamw_lr": NON_NEGATIVE, "beta1": UNIT, "beta2": UNIT}
# Fields whose default None means "unset" (TOML cannot write it; the command line can leave it).
OPTIONAL_FIELDS = ("adamw_lr",)
# What a field's message adds after its interval.
NUMBER_NOTES = {"adamw_lr": " (leave it out to use lr)"}
# The on/off fields only TOML has (dmuon checks its own on/off options with
# its own message): true / false only, since a string "false" would be truthy.
FLAG_FIELDS = ("split_attention_heads", "track_max_logits", "telemetry", "skip_nonfinite", "early_step_in_backward",
               "capture_step")
# How the 0.2.x config spells a boolean.
FLAG_SPELLING = "true or false"
# The config half TorchTitan must parse with, and a field only it adds to [optimizer].
CONFIG_MODULE = "torchtitan_ext"
CONFIG_MODULE_FIELD = "adamw_param_regex"


@contextlib.contextmanager
def _toml_spellings() -> Iterator[None]:
    """DMuon's message names Python values (``None``, ``True``); for the fields TOML
    spells differently, append the TOML spellings to it."""
    try:
        yield
    except ValueError as error:
        for field, spellings in TOML_CHOICES.items():
            if f" {field} " in str(error):
                raise ValueError(f"{error}; in TOML, {field} is one of {', '.join(map(repr, spellings))}") from None
        if " qk_clip_threshold " in str(error):  # DMuon's message says None is off; in TOML it is 0
            raise ValueError(f"{error}; in TOML, qk_clip_threshold = 0 turns QK-clip off") from None
        raise


def validate_optimizer_config(optimizer_config: Any) -> None:
    """Raise ``ValueError`` if a DMuon setting cannot work: dmuon's own message, with
    ``[optimizer]`` where ``DMuon(...)`` says ``DMuon``.

    Every option DMuon takes is checked by the validator ``DMuon(...)`` calls, on the
    value ``dmuon_kwargs`` passes it; only the TOML-only keys (``early_step_in_backward``,
    ``adamw_param_regex``) have rules here. Only checks anything when
    ``[optimizer] name = "DMuon"``.
    """
    cfg = optimizer_config
    if cfg.name != DMUON_NAME:
        return
    check_fields_as_written(cfg)
    if cfg.early_step_in_backward:
        raise ValueError(
            f"{WHERE} early_step_in_backward = true is not supported with "
            f'name = "{DMUON_NAME}": Muon orthogonalizes whole matrices after the '
            "backward pass (and gradient clipping), not one parameter inside it. "
            "Set early_step_in_backward = false."
        )
    try:
        re.compile(cfg.adamw_param_regex)
    except (re.error, TypeError) as e:
        raise ValueError(
            f"{WHERE} adamw_param_regex = {cfg.adamw_param_regex!r} is not a valid "
            f"Python regular expression ({e}). In TOML, write it as a literal string in "
            "single quotes so backslashes stay as typed."
        ) from e
    kwargs = dmuon_kwargs(cfg)
    muon, adamw = split_options(kwargs)  # the options TOML has no field for keep DMuon's defaults
    # In DMuon.__init__'s order, so that a config with several bad values reports the one
    # DMuon would report first.
    with _toml_spellings():
        check_group(muon, True, WHERE)
        check_group(adamw, False, f"{WHERE} (AdamW part)")
        check_optimizer_options(kwargs, WHERE)


def check_fields_as_written(optimizer_config: Any) -> None:
    """Each on/off field a boolean, each number finite and in its range, the message
    naming the [optimizer] field as the TOML spells it."""
    for name in FLAG_FIELDS:
        check_flag(getattr(optimizer_config, name), name, f"{WHERE}:", FLAG_SPELLING)
    for name, interval in NUMBER_FIELDS.items():
        value = getattr(optimizer_config, name)
        if value is None and name in OPTIONAL_FIELDS:
            continue
        check_number(value, name, f"{WHERE}:", interval, NUMBER_NOTES.get(name, ""))


def check_no_fault_tolerance(config: Any) -> None:
    """TorchFT's optimizer wrapper is TorchTitan's AdamW container: refuse DMuon with it
    while parsing rather than after the model is built."""
    if config.optimizer.name == DMUON_NAME and getattr(config.fault_tolerance, "enable", False):
        raise ValueError(
            f'{WHERE} name = "{DMUON_NAME}" does not support TorchFT: set [fault_tolerance] enable = false '
            "(or train with name = \"AdamW\" under fault tolerance)."
        )


# TorchTitan 0.2.x's name of the float8 converter (model.converters), and the async modes.
FLOAT8_CONVERTER = "quantize.linear.float8"
CHECKPOINT_SYNC = "disabled"


def check_no_async_checkpoint_of_float8_weights(config: Any) -> None:
    """Refuse an asynchronous checkpoint of FSDP float8 weights while parsing: torch's DCP
    stager (``dcp.async_save``, both async modes; torch 2.13 and 2.15) copies torchao's
    ``WeightWithDynamicFloat8CastTensor``, the local tensor of every such weight, as a
    plain tensor of uninitialized memory, so the checkpoint's weights are garbage and a
    resume trains on NaN (seen with AdamW alike; docs/torchtitan.md). A synchronous
    checkpoint, or float8 without FSDP float8 all-gather (plain weights), saves them right."""
    float8 = config.quantize.linear.float8
    if (config.optimizer.name == DMUON_NAME and FLOAT8_CONVERTER in config.model.converters
            and float8.enable_fsdp_float8_all_gather and config.checkpoint.enable
            and config.checkpoint.async_mode != CHECKPOINT_SYNC):
        raise ValueError(
            f'[checkpoint] async_mode = "{config.checkpoint.async_mode}" with float8 weights all-gathered by FSDP '
            "([quantize.linear.float8] enable_fsdp_float8_all_gather = true) writes corrupt checkpoints: torch's "
            "asynchronous stager copies torchao's float8 weight wrapper as uninitialized memory, and a resume trains "
            f'on NaN. Set async_mode = "{CHECKPOINT_SYNC}", or enable_fsdp_float8_all_gather = false.')


def check_config_module_named(config: Any) -> None:
    """``name = "DMuon"`` reads DMuon's [optimizer] fields, which exist only when TorchTitan
    parsed the config with ``[job] custom_config_module``: without it the job would build
    the model and then fail on a missing attribute. Say which line to add."""
    if config.optimizer.name == DMUON_NAME and not hasattr(config.optimizer, CONFIG_MODULE_FIELD):
        raise ValueError(
            f'{WHERE} name = "{DMUON_NAME}" needs DMuon\'s [optimizer] fields and their checks, which TorchTitan '
            f'adds only while parsing with the config half of the extension: add [job] custom_config_module = '
            f'"{CONFIG_MODULE}" to the TOML (or --job.custom_config_module {CONFIG_MODULE}).'
        )


def check_job_module_imported(config: Any) -> None:
    """``name = "DMuon"`` builds DMuon only once ``torchtitan_ext.titan02.job`` ran: say so
    at parse time instead of TorchTitan's "Optimizer DMuon not added" after start-up."""
    if config.optimizer.name == DMUON_NAME and not config.experimental.custom_import:
        raise ValueError(
            f'{WHERE} name = "{DMUON_NAME}" needs the job half of the extension: add '
            f'[experimental] custom_import = "{JOB_MODULE}" (or import that module from '
            "your own custom_import module)."
        )


def install_config_validation() -> None:
    """Run ``validate_optimizer_config`` whenever TorchTitan validates a parsed config.

    TorchTitan merges our dataclass fields into a new class based on its own, so a
    ``__post_init__`` here would never run, and 0.2.x has no validation hook;
    wrapping ``ConfigManager._validate_config`` is the one place that sees every
    parsed config (TOML and command line). It is installed when TorchTitan reads
    ``torchtitan_ext.JobConfig``, i.e. only for a job whose config names this
    extension (``torchtitan_ext/__init__.py``).
    """
    from torchtitan.config.manager import ConfigManager

    original = ConfigManager._validate_config
    if getattr(original, "_dmuon_validation", False):
        return
    require_tested("0.2", "ConfigManager._validate_config (DMuon's [optimizer] checks at parse time)")

    @functools.wraps(original)
    def validate_config(self) -> None:
        original(self)
        check_config_module_named(self.config)  # (a process that parsed with it before)
        validate_optimizer_config(self.config.optimizer)
        check_job_module_imported(self.config)
        check_no_fault_tolerance(self.config)
        check_no_async_checkpoint_of_float8_weights(self.config)

    validate_config._dmuon_validation = True  # type: ignore[attr-defined]
    ConfigManager._validate_config = validate_config
