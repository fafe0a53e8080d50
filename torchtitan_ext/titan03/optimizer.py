"""DMuon as a TorchTitan 0.3.x optimizer: a container subclass and its config.

TorchTitan 0.3 names optimizers per parameter group
(``ParamGroupConfig(pattern, optimizer_name, optimizer_kwargs)``) and turns a name
into a factory through a fixed dict, with no registry. ``DMuonOptimizersContainer``
adds ``"DMuon"`` to that dict; everything else (one optimizer per name per model
part, flat FQN-keyed checkpoint state, ``init_optim_state``, step hooks, the LR
schedulers) stays TorchTitan's own code. Users write::

    config.optimizer = dmuon_optimizer(lr=0.02, weight_decay=0.1)

How a DMuon group is split into Muon and AdamW groups (a choice, explained there) is
``groups``; which option goes in a group and which in the whole optimizer, and the
checks ``Config.__post_init__`` runs on them, is ``options``. Importing this module
changes nothing in TorchTitan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.tools.logging import logger

from dmuon import DEFAULT_NS_COEFFICIENTS_NAME, DMuon, StepFigures
from dmuon.options import MUON_KEYS

from ..captured_steps import capture_refusal, CapturedSteps
from ..implementation import dmuon_implementation
from ..routing import check_some_muon, DEFAULT_ADAMW_PARAM_REGEX, muon_embeddings_warning
from ..state_size import log_state_size_after_first_step
from ..step_figures import combined_figures
from .groups import check_whole_or_dtensor, split_dmuon_group
from .max_logits import install_qk_clip, qk_clip_enabled
from .options import CAPTURE_STEP, DMUON_DEFAULTS, DMUON_NAME, FACTORY_DEFAULTS, FACTORY_OPTIONS, validate_dmuon_config


# The config field that captures the step, as messages name it.
CAPTURE_FIELD = f"optimizer.optimizer_factory_kwargs_by_name[{DMUON_NAME!r}][{CAPTURE_STEP!r}]"


# -------------------------------------------------------------------- container
class DMuonOptimizersContainer(CapturedSteps, OptimizersContainer):
    """TorchTitan 0.3's ``OptimizersContainer`` that also builds ``"DMuon"`` groups."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``OptimizersContainer.Config`` whose DMuon settings are checked on creation
        (the Trainer's command-line parser creates it again with the overrides)."""

        def __post_init__(self) -> None:
            validate_dmuon_config(self)

    def __init__(self, config: OptimizersContainer.Config, *, model_parts: list[nn.Module]) -> None:
        self.implementation = config.implementation  # DMuon's foreach / fused (_resolve_optimizer_factory)
        super().__init__(config, model_parts=model_parts)
        self._check_routing(config, model_parts)
        # QK-clip: each part's DMuon watches that part's attentions (``max_logits.py``).
        self.qk_clip_hooks = []
        for model in model_parts:
            dmuon = self._dmuon_of(model)
            if dmuon is not None and qk_clip_enabled(dmuon):
                self.qk_clip_hooks += install_qk_clip(model, dmuon)
        if config.optimizer_factory_kwargs_by_name.get(DMUON_NAME, {}).get(CAPTURE_STEP):
            self.capture_optimizer_steps()
        log_state_size_after_first_step(self.optimizers, logger.info)

    def _check_routing(self, config: OptimizersContainer.Config, model_parts: list[nn.Module]) -> None:
        """Refuse a DMuon whose ``adamw_param_regex`` left Muon no matrix; warn when it
        routes an embedding or the output head to Muon (``torchtitan_ext.routing``)."""
        dmuons = [o for o in self.optimizers if isinstance(o, DMuon)]
        if not dmuons:
            return
        regex = next((g.optimizer_kwargs.get("adamw_param_regex", DEFAULT_ADAMW_PARAM_REGEX)
                      for g in config.param_groups if g.optimizer_name == DMUON_NAME), DEFAULT_ADAMW_PARAM_REGEX)
        in_muon = {id(p) for o in dmuons for g in o.param_groups if g["use_muon"] for p in g["params"]}
        mine = [p for o in dmuons for g in o.param_groups for p in g["params"]]
        owned = {id(p) for p in mine}
        check_some_muon(model_parts, lambda p: id(p) in in_muon or id(p) not in owned, regex)
        if warning := muon_embeddings_warning(model_parts, lambda p: id(p) in in_muon, regex):
            logger.warning(warning)

    def _dmuon_of(self, model: nn.Module) -> DMuon | None:
        """The DMuon built for model part ``model`` (TorchTitan builds one per part)."""
        mine = {id(p) for p in model.parameters()}
        for optimizer in self.optimizers:
            if isinstance(optimizer, DMuon) and any(id(p) in mine for g in optimizer.param_groups
                                                    for p in g["params"]):
                return optimizer
        return None

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., Optimizer]:  # type: ignore[override]
        """TorchTitan's factory, or for ``"DMuon"`` one that gives DMuon ``implementation``
        as its ``foreach`` / ``fused`` (TorchTitan calls this on the instance)."""
        if name == DMUON_NAME:
            return functools.partial(build_dmuon, implementation=self.implementation)
        return OptimizersContainer._resolve_optimizer_factory(name)

    @staticmethod
    def _build_param_groups(
        model: nn.Module, param_group_configs: list[ParamGroupConfig], impl_kwargs: dict[str, Any]
    ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[str]]]:
        """TorchTitan's groups, with each DMuon group split by ``split_dmuon_group``
        (the patterns, used for logging only, repeated to stay aligned) and its
        Muon parameters checked by ``check_whole_or_dtensor``."""
        groups, patterns = OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        if DMUON_NAME in groups:
            # One group per DMuon config, in order (TorchTitan refuses a pattern matching nothing).
            configs = [config for config in param_group_configs if config.optimizer_name == DMUON_NAME]
            split = [split_dmuon_group(model, group, config.optimizer_kwargs)
                     for group, config in zip(groups[DMUON_NAME], configs)]
            patterns[DMUON_NAME] = [p for p, parts in zip(patterns[DMUON_NAME], split) for _ in parts]
            groups[DMUON_NAME] = [part for parts in split for part in parts]
            for group in groups[DMUON_NAME]:
                if group["use_muon"]:
                    check_whole_or_dtensor(group["param_names"], group["params"])
        return groups, patterns

    def telemetry(self) -> StepFigures | None:
        """The last step's figures of this rank's DMuon optimizers together, or ``None``
        when telemetry is off, no step ran, or no optimizer is a DMuon."""
        return combined_figures([o.telemetry() for o in self.optimizers if isinstance(o, DMuon)])


def build_dmuon(param_groups: list[dict[str, Any]], *, implementation: str, **factory_options: Any) -> DMuon:
    """DMuon for one model part, with ``optimizer.implementation`` as its ``foreach`` /
    ``fused`` (``torchtitan_ext.implementation``: ``"fused"`` fuses the AdamW part where
    torch has the kernel for every parameter of the part)."""
    params = [p for group in param_groups for p in group["params"]]
    capturable = factory_options.pop(CAPTURE_STEP, False)  # the container captures the step
    if capturable and (refusal := capture_refusal(params, CAPTURE_FIELD)):
        raise ValueError(refusal)
    return DMuon(param_groups, **dmuon_implementation(implementation, params), capturable=capturable,
                 **factory_options)


# ------------------------------------------------------------------- convenience
def dmuon_optimizer(
    lr: float = DMUON_DEFAULTS["lr"],
    *,
    adamw_param_regex: str = DEFAULT_ADAMW_PARAM_REGEX,
    split_attention_heads: bool = False,
    factory_options: dict[str, Any] | None = None,
    **group_options: Any,
) -> DMuonOptimizersContainer.Config:
    """A config with one ``".*"`` DMuon group, like TorchTitan's ``default_adamw``.

    ``group_options``: any DMuon group option (``momentum=0.9``, ``adamw_lr=3e-4``,
    ``normuon=True``; ``cautious_weight_decay`` applies to the AdamW part too; ``foreach`` /
    ``fused`` override ``optimizer.implementation`` for the group);
    ``factory_options``: the whole-optimizer ones (``{"telemetry": True}``). Every
    option is written into the config with its value (DMuon's default unless given),
    so each can be overridden from the command line, e.g.
    ``--optimizer.param_groups.0.optimizer_kwargs.ns_steps 6`` or
    ``--optimizer.optimizer_factory_kwargs_by_name.DMuon.comm redistribute``.
    The command line can change a value's type from the config function's only
    within what tyro reads from it, and cannot turn a ``None`` into a number: group
    options whose default is ``None`` (``adamw_lr``, ``adamw_weight_decay``,
    ``split_rows``) are written only when given, and ``split_replicas`` (``None``:
    the cost model decides) is settable on the command line only if the config
    function set it to a bool.
    """
    defaults = {k: DMUON_DEFAULTS[k] for k in (*MUON_KEYS, "adamw_betas", "adamw_eps") if k != "lr"}
    defaults["ns_coefficients"] = DEFAULT_NS_COEFFICIENTS_NAME  # a name: one command-line string
    kwargs = {"lr": lr, **defaults, **group_options,
              "adamw_param_regex": adamw_param_regex, "split_attention_heads": split_attention_heads}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in group_options}
    factory = {k: FACTORY_DEFAULTS[k] for k in FACTORY_OPTIONS} | (factory_options or {})
    return DMuonOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=DMUON_NAME, optimizer_kwargs=kwargs)],
        optimizer_factory_kwargs_by_name={DMUON_NAME: factory},
    )
