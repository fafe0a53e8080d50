"""DMuon as a TorchTitan 0.3.x optimizer: a container subclass and its config.

TorchTitan 0.3 names optimizers per parameter group
(``ParamGroupConfig(pattern, optimizer_name, optimizer_kwargs)``) and turns a name
into a factory through a fixed dict, with no registry. ``DMuonOptimizersContainer``
adds ``"DMuon"`` to that dict; everything else (one optimizer per name per model
part, flat FQN-keyed checkpoint state, ``init_optim_state``, step hooks, the LR
schedulers) stays TorchTitan's own code. Users write::

    config.optimizer = dmuon_optimizer(lr=0.02, weight_decay=0.1)

Routing (a choice, explained): one ``".*"`` DMuon group by default, which the
container splits per model part with the shared rule (``torchtitan_ext.routing``):
matrices -> Muon, embeddings / output head / norms / anything not a real matrix ->
AdamW (DMuon's own AdamW part). Separate AdamW ``ParamGroupConfig`` patterns would
need the user to restate that rule as regexes, cannot say "1-D or complex", and
TorchTitan raises for a pattern that matches no parameter -- which a pipeline stage
without the embedding or the head would hit. Both Muon and AdamW of a part live in
one DMuon, which also gives one telemetry record per part.

Options, where they go:

* group options (``lr``, ``momentum``, ``ns_steps``, ``ns_algorithm``, ..., the update-rule variants
  ``normuon`` / ``normuon_beta2`` / ``cautious_weight_decay``, the AdamW part's
  ``adamw_lr`` / ``adamw_betas`` / ``adamw_eps`` / ``adamw_weight_decay``) and the
  routing keys ``adamw_param_regex`` and ``split_attention_heads``: the group's
  ``optimizer_kwargs``;
* whole-optimizer options (``comm``, ``max_batch_numel``, ``split_replicas``,
  ``ns_dtype``, ``link_gbps``, ``replica_link_gbps``, ``telemetry``):
  ``optimizer_factory_kwargs_by_name["DMuon"]``.

TorchTitan adds ``fused`` / ``foreach`` (from ``implementation``) to every group
dict; DMuon has one implementation (its AdamW part is its own loop), so the
container drops them from DMuon's groups, and a DMuon group that sets them itself is
refused while the config is built. Every value is checked in ``Config.__post_init__``
(so also after command-line overrides) by dmuon's own validators, with the config
field in the message. Importing this module changes nothing in TorchTitan.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from dmuon import DMuon
from dmuon.numerics.newton_schulz import DEFAULT_NS_COEFFICIENTS_NAME
from dmuon.options import check_link_gbps, check_ns_dtype, check_optimizer_options
from dmuon.param_groups import GROUP_OPTIONS, MUON_KEYS, make_group, split_options
from dmuon.telemetry import StepFigures

from ..routing import ADAMW, DEFAULT_ADAMW_PARAM_REGEX, MUON, MUON_HEADS, attention_head_dims, route_parameters
from ..step_figures import combined_figures
from .max_logits import install_qk_clip, qk_clip_enabled

DMUON_NAME = "DMuon"
# Keys TorchTitan's ``implementation`` adds to every group dict; DMuon takes neither.
IMPLEMENTATION_KEYS = ("fused", "foreach")
# Group keys the container reads to split a DMuon group (DMuon never sees them).
ROUTING_KEYS = ("adamw_param_regex", "split_attention_heads")
# DMuon's options that are the whole optimizer's (its constructor's, not a group's).
FACTORY_OPTIONS = ("comm", "max_batch_numel", "split_replicas", "ns_dtype", "link_gbps",
                   "replica_link_gbps", "telemetry")
# DMuon's constructor defaults, read from its signature so they cannot drift.
DMUON_DEFAULTS = {
    name: p.default for name, p in inspect.signature(DMuon.__init__).parameters.items()
    if p.default is not inspect.Parameter.empty
}


# ------------------------------------------------------------------ config checks
def check_group_options(options: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` for a DMuon group's bad key or value.

    The values are checked by the validator ``DMuon(...)`` runs on each group it
    builds (``dmuon.param_groups``), with this group's options over DMuon's defaults.
    """
    use_muon = options.get("use_muon")
    if use_muon is not None and not isinstance(use_muon, bool):
        raise ValueError(f"{where}: use_muon must be a bool, got {use_muon!r}")
    for key in IMPLEMENTATION_KEYS:
        if key in options:
            raise ValueError(f"{where}: {key!r} does not apply to DMuon (it has one implementation); "
                             "remove it (optimizer.implementation applies to Adam/AdamW groups only)")
    routing = ROUTING_KEYS if use_muon is None else ()
    known = GROUP_OPTIONS[use_muon] | set(routing) | {"use_muon"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)} for a DMuon group"
                         f"{'' if use_muon is None else f' with use_muon={use_muon}'}; known: {sorted(known)} "
                         f"(whole-optimizer options go in optimizer.optimizer_factory_kwargs_by_name"
                         f"[{DMUON_NAME!r}])")
    _check_routing(options, where)
    muon_defaults, adamw_defaults = split_options(DMUON_DEFAULTS)
    for kind in (True, False) if use_muon is None else (use_muon,):
        mine = {k: v for k, v in options.items() if k in GROUP_OPTIONS[kind]}
        defaults = muon_defaults if kind else adamw_defaults
        make_group([], kind, False, mine, defaults, where if kind else f"{where} (AdamW part)")


def _check_routing(options: dict[str, Any], where: str) -> None:
    regex = options.get("adamw_param_regex", DEFAULT_ADAMW_PARAM_REGEX)
    try:
        re.compile(regex)
    except (re.error, TypeError) as error:
        raise ValueError(f"{where}: adamw_param_regex {regex!r} is not a Python regular expression "
                         f"({error})") from None
    heads = options.get("split_attention_heads", False)
    if not isinstance(heads, bool):
        raise ValueError(f"{where}: split_attention_heads must be a bool, got {heads!r}")


def check_factory_options(options: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` for a bad whole-optimizer option."""
    unknown = set(options) - set(FACTORY_OPTIONS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; it takes DMuon's whole-optimizer "
                         f"options {list(FACTORY_OPTIONS)} (group options go in a param group's "
                         "optimizer_kwargs)")
    merged = {**DMUON_DEFAULTS, **options}
    check_optimizer_options(merged["comm"], merged["max_batch_numel"], merged["split_replicas"], where)
    check_ns_dtype(merged["ns_dtype"], where)
    for name in ("link_gbps", "replica_link_gbps"):
        check_link_gbps(merged[name], name, where)
    if not isinstance(merged["telemetry"], bool):
        raise ValueError(f"{where}: telemetry must be a bool, got {merged['telemetry']!r}")


def validate_dmuon_config(config: OptimizersContainer.Config) -> None:
    """Check every DMuon setting of an optimizer config; the message names the field."""
    for index, group in enumerate(config.param_groups):
        if group.optimizer_name == DMUON_NAME:
            check_group_options(group.optimizer_kwargs, f"optimizer.param_groups[{index}].optimizer_kwargs")
    factory = config.optimizer_factory_kwargs_by_name.get(DMUON_NAME)
    if factory is not None:
        check_factory_options(factory, f"optimizer.optimizer_factory_kwargs_by_name[{DMUON_NAME!r}]")


# ---------------------------------------------------------------------- routing
def kinds_of(model: nn.Module, regex: str, split_heads: bool) -> dict[int, tuple[str, int | None]]:
    """id(parameter) -> (MUON_HEADS | MUON | ADAMW, split_rows) by the shared rule."""
    routed = route_parameters(model, regex)
    heads = attention_head_dims(model) if split_heads else {}
    kinds: dict[int, tuple[str, int | None]] = {id(p): (ADAMW, None) for _, p in routed.adamw}
    for _, param in routed.muon:
        kinds[id(param)] = (MUON_HEADS, heads[param]) if param in heads else (MUON, None)
    return kinds


def split_dmuon_group(model: nn.Module, group: dict[str, Any]) -> list[dict[str, Any]]:
    """One of TorchTitan's group dicts for DMuon -> DMuon's groups, each with ``use_muon``.

    Drops the ``fused``/``foreach`` keys TorchTitan adds. A group that sets
    ``use_muon`` is kept whole; otherwise it is split into per-head Muon (one group
    per head size), Muon and AdamW groups, each with the options that apply to it.
    """
    options = {k: v for k, v in group.items() if k not in ("params", "param_names", *IMPLEMENTATION_KEYS)}
    if "use_muon" in options:
        return [{"params": group["params"], "param_names": group["param_names"], **options}]
    regex = options.pop("adamw_param_regex", DEFAULT_ADAMW_PARAM_REGEX)
    kinds = kinds_of(model, regex, options.pop("split_attention_heads", False))
    members: dict[tuple[str, int | None], list[tuple[str, nn.Parameter]]] = {}
    for name, param in zip(group["param_names"], group["params"]):
        members.setdefault(kinds[id(param)], []).append((name, param))
    order = sorted(members, key=lambda kind: ((MUON_HEADS, MUON, ADAMW).index(kind[0]), kind[1] or 0))
    return [_group_of(kind, members[kind], options) for kind in order]


def _group_of(kind: tuple[str, int | None], members: list[tuple[str, nn.Parameter]],
              options: dict[str, Any]) -> dict[str, Any]:
    use_muon = kind[0] != ADAMW
    group = {"params": [p for _, p in members], "param_names": [n for n, _ in members], "use_muon": use_muon}
    group.update({k: v for k, v in options.items() if k in GROUP_OPTIONS[use_muon]})
    if kind[0] == MUON_HEADS:
        group["split_rows"] = kind[1]
    return group


# -------------------------------------------------------------------- container
def check_whole_or_dtensor(names: list[str], params: list[nn.Parameter]) -> None:
    """Refuse a plain-tensor Muon parameter that ``spmd_types`` marks as differing across
    the ranks of a mesh axis (``V``, e.g. a TP shard, or ``P``).

    Under ``parallelism.spmd_backend = "spmd_types"`` TorchTitan shards TP/EP weights
    as plain local tensors carrying an ``spmd_types`` annotation; FSDP's
    ``fully_shard`` (which TorchTitan's parallelize functions always apply) turns
    them into DTensors, which DMuon understands. A path that skipped that step would
    hand DMuon a slice it takes for a whole matrix: wrong math, no error. So refuse.
    """
    try:
        import spmd_types as spmd
    except ImportError:  # no annotations can exist
        return
    for name, param in zip(names, params):
        if isinstance(param, DTensor):
            continue
        for axis, axis_type in spmd.get_local_type(param).items():
            if axis.size() > 1 and axis_type not in (spmd.R, spmd.I):
                raise ValueError(
                    f"DMuon: parameter {name!r} is a plain tensor that spmd_types "
                    f"marks {axis_type} on mesh axis {axis} ({axis.size()} ranks): each rank holds a "
                    "different part of it, and Muon must orthogonalize whole matrices. DMuon needs it "
                    "as a DTensor: keep FSDP applied (TorchTitan's parallelize functions turn the "
                    "annotations into DTensors), or set parallelism.spmd_backend = \"full_dtensor\"."
                )


class DMuonOptimizersContainer(OptimizersContainer):
    """TorchTitan 0.3's ``OptimizersContainer`` that also builds ``"DMuon"`` groups."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``OptimizersContainer.Config`` whose DMuon settings are checked on creation
        (the Trainer's command-line parser creates it again with the overrides)."""

        def __post_init__(self) -> None:
            validate_dmuon_config(self)

    def __init__(self, config: OptimizersContainer.Config, *, model_parts: list[nn.Module]) -> None:
        super().__init__(config, model_parts=model_parts)
        # QK-clip: each part's DMuon watches that part's attentions (``max_logits.py``).
        self.qk_clip_hooks = []
        for model in model_parts:
            dmuon = self._dmuon_of(model)
            if dmuon is not None and qk_clip_enabled(dmuon):
                self.qk_clip_hooks += install_qk_clip(model, dmuon)

    def _dmuon_of(self, model: nn.Module) -> DMuon | None:
        """The DMuon built for model part ``model`` (TorchTitan builds one per part)."""
        mine = {id(p) for p in model.parameters()}
        for optimizer in self.optimizers:
            if isinstance(optimizer, DMuon) and any(id(p) in mine for g in optimizer.param_groups
                                                    for p in g["params"]):
                return optimizer
        return None

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        if name == DMUON_NAME:
            return DMuon
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
            split = [split_dmuon_group(model, group) for group in groups[DMUON_NAME]]
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
    ``normuon=True``; ``cautious_weight_decay`` applies to the AdamW part too);
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
    factory = {k: DMUON_DEFAULTS[k] for k in FACTORY_OPTIONS} | (factory_options or {})
    return DMuonOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=DMUON_NAME, optimizer_kwargs=kwargs)],
        optimizer_factory_kwargs_by_name={DMUON_NAME: factory},
    )
