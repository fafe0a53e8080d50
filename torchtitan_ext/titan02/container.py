"""Build TorchTitan's ``OptimizersContainer`` out of DMuon optimizers.

TorchTitan keeps one optimizer per *model part* (one part per pipeline stage;
one part in total without pipeline parallelism) inside an
``OptimizersContainer``; checkpointing, LR scheduling and hooks all go through
that container. We reuse the container class and only change what sits inside:
one ``dmuon.DMuon`` per part, holding up to three parameter groups:

1. with ``[optimizer] split_attention_heads``, a **per-head Muon group**: the
   attention ``wq``/``wk``/``wv`` weights, ``split_rows`` = the model's head size;
2. the **Muon group** (``use_muon=True``): every other parameter with >= 2
   dimensions whose name does not match ``[optimizer] adamw_param_regex``;
3. the **AdamW group** (``use_muon=False``): the rest -- embeddings, output head,
   norms by default, plus every 0-D/1-D parameter (biases, scales) and every complex
   one (``dmuon.default_use_muon`` decides, with the regex).

Group layout rule (a choice, explained): TorchTitan saves only the *first*
stage's LR-scheduler state and loads it into every stage's scheduler, so all
parts must have the same number and order of groups. We decide the layout once
for the whole model -- [Muon, AdamW], minus a kind the model has no parameter
of -- and give every part that layout. A part that would get an empty group
(an empty group breaks checkpoint loading) is a configuration error we report,
naming the part and the fix, instead of silently mis-scheduling learning rates.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from dmuon import DMuon, StepFigures

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from ..routing import (
    ADAMW,
    check_some_muon,
    group_layout,
    MUON_HEADS,
    muon_embeddings_warning,
    route_parameters,
    RoutedParameters,
)
from ..captured_steps import capture_refusal, CapturedSteps
from .max_logits import install_max_logit_hooks, require_attentions
from ..state_size import log_state_size_after_first_step
from ..step_figures import combined_figures
from .kwargs import dmuon_kwargs, qk_clip_wanted
from .validation import validate_optimizer_config


# The config field that captures the step, as messages name it.
CAPTURE_FIELD = "[optimizer] capture_step"


def _numel(params: list[tuple[str, nn.Parameter]]) -> int:
    return sum(p.numel() for _, p in params)


class DMuonOptimizersContainer(CapturedSteps, OptimizersContainer):
    """``OptimizersContainer`` with one ``dmuon.DMuon`` per model part.

    Everything else -- ``step``, ``zero_grad`` (but under ``capture_step``:
    ``torchtitan_ext.captured_steps``), DCP ``state_dict`` / ``load_state_dict``, step
    hooks, and being iterated by the LR-scheduler container -- is TorchTitan's own code.
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_kwargs: dict[str, Any],
        adamw_param_regex: str,
        split_attention_heads: bool = False,
    ) -> None:
        self.model_parts = model_parts
        self.optimizers = []
        routed_parts = [route_parameters(m, adamw_param_regex, split_attention_heads) for m in model_parts]
        layout = group_layout(routed_parts)
        in_muon = {id(p) for r in routed_parts for _, p in (*r.muon, *r.muon_heads)}
        check_some_muon(model_parts, lambda p: id(p) in in_muon, adamw_param_regex)
        if warning := muon_embeddings_warning(model_parts, lambda p: id(p) in in_muon, adamw_param_regex):
            logger.warning(warning)
        head_dims = set().union(*(r.head_dims for r in routed_parts))
        if len(head_dims) > 1:
            raise ValueError(f"DMuon: split_attention_heads needs one head size, the model has {sorted(head_dims)}")
        self.head_dim = next(iter(head_dims), None)
        all_params: list[nn.Parameter] = []
        for index, routed in enumerate(routed_parts):
            groups = [self._group(kind, routed, optimizer_kwargs, self.head_dim) for kind in layout]
            self.optimizers.append(DMuon(groups, **optimizer_kwargs))
            all_params.extend(p for g in groups for _, p in g["params"])
            logger.info(
                f"DMuon (model part {index}): {len(routed.muon)} tensors "
                f"({_numel(routed.muon):,} params) -> Muon, {len(routed.muon_heads)} tensors "
                f"({_numel(routed.muon_heads):,} params) -> Muon per head ({self.head_dim} rows), "
                f"{len(routed.adamw)} tensors "
                f"({_numel(routed.adamw):,} params) -> AdamW; groups {layout}"
            )
        self._validate_length(len(model_parts))
        # Gives the container its own param_groups and hook machinery, as in
        # TorchTitan's base class (the inner DMuon instances do the real work).
        self._post_init(all_params, optimizer_kwargs)
        log_state_size_after_first_step(self.optimizers, logger.info)

    def telemetry(self) -> StepFigures | None:
        """The last step's figures of all model parts on this rank together, or ``None``
        when ``[optimizer] telemetry`` is off (read by ``step_metrics``)."""
        return combined_figures([optimizer.telemetry() for optimizer in self.optimizers])

    @staticmethod
    def _group(kind: str, routed: RoutedParameters, kwargs: dict[str, Any], head_dim: int | None) -> dict[str, Any]:
        group: dict[str, Any] = {
            # (name, tensor) pairs: DMuon reports problems by parameter name.
            "params": list(routed.of_kind(kind)),
            "use_muon": kind != ADAMW,
        }
        if kind == MUON_HEADS:
            group["split_rows"] = head_dim
        # Give the AdamW group its lr explicitly: TorchTitan's LambdaLR scales each
        # group's lr as found at construction, so it must be the AdamW lr already.
        if kind == ADAMW and kwargs.get("adamw_lr") is not None:
            group["lr"] = kwargs["adamw_lr"]
        return group


def build_dmuon_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: Any,
    parallel_dims: Any,
    ft_manager: Any = None,
) -> DMuonOptimizersContainer:
    """TorchTitan ``build_optimizers_fn`` for ``[optimizer] name = "DMuon"``.

    Same signature as ``torchtitan.components.optimizer.build_optimizers``.
    """
    validate_optimizer_config(optimizer_config)
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise NotImplementedError(
            '[optimizer] name = "DMuon" does not support TorchFT ([fault_tolerance] enable).'
        )
    params = [p for model in model_parts for p in model.parameters() if p.requires_grad]
    if optimizer_config.capture_step and (refusal := capture_refusal(params, CAPTURE_FIELD)):
        raise ValueError(refusal)
    container = DMuonOptimizersContainer(
        model_parts, dmuon_kwargs(optimizer_config, params), optimizer_config.adamw_param_regex,
        optimizer_config.split_attention_heads,
    )
    if qk_clip_wanted(optimizer_config):
        hook_attentions(container, parallel_dims)
    if optimizer_config.capture_step:
        container.capture_optimizer_steps()
    return container


def hook_attentions(container: DMuonOptimizersContainer, parallel_dims: Any) -> None:
    """QK-clip: each model part's attentions report their logits to, and are clipped by,
    that part's DMuon (under pipeline parallelism, only the stage's own layers)."""
    require_attentions(container.model_parts)
    tp = parallel_dims is not None and parallel_dims.tp_enabled  # None: a single-process test
    tp_rank = parallel_dims.get_mesh("tp").get_local_rank() if tp else 0
    cp = parallel_dims is not None and parallel_dims.cp_enabled
    for model, optimizer in zip(container.model_parts, container.optimizers):
        install_max_logit_hooks(model, optimizer, tp_rank=tp_rank, context_parallel=cp)
