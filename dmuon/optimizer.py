"""DMuon: Muon for matrices, AdamW for the rest, native to DTensor/FSDP2.

``DMuon.step`` runs the five phases of ``dmuon.step.phases`` (check locally, agree, wait,
compute and apply, report); before them the plan is made (at the first step) and the last
step's status read (its host changes taken back if it was masked, ``dmuon.state.rollback``).
The math is ``dmuon.numerics.update_rules`` and ``adamw_rules`` (run with a group's settings,
counted and timed, by ``dmuon.step.group_steps``); the groups are ``dmuon.options.param_groups``'.

The collectives a rank runs depend only on the parameters, never on its grads, values
or errors, so ranks cannot fall out of step; no host collective runs in a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

from dmuon.attention.max_logits import MaxLogitTracker
from dmuon.attention.qk_clip import AttentionHeads
from dmuon.options.device_hyperparameters import held_values, keep_after_load, place_on_device
from dmuon.exchange.comm import CommStats, ScratchMeter
from dmuon.step.fast_path import FastPath
from dmuon.step.group_steps import MUON_STATE_KEYS
from dmuon.state.kept_state import ADAMW_MOMENTS, convert_loaded
from dmuon.options.implementation_flags import check_optimizer_flags
from dmuon.options.param_groups import build_param_groups, split_options
from dmuon.options.table import (ADAMW_ALIASES, DEFAULTS as D, OPTIMIZER_ATTRIBUTES, check_group,
                                 check_optimizer_options)
from dmuon.state.optimizer_hooks import attach_hooks
from dmuon.state.pickling import PicklesConfiguration
from dmuon.state.loading import keep_saved_dtypes, keep_state_tensors, state_tensors
from dmuon.plan.owner_plan import OwnerPlan
from dmuon.step.phases import StepOptions, StepPhases
from dmuon.step.telemetry import StateBytes, StepFigures, Telemetry, state_bytes
from dmuon.torch_compat import local_of

ParamsArg = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]

class DMuon(PicklesConfiguration, Optimizer):
    """Distributed Muon with an AdamW fallback, for plain tensors and DTensors.

    Args (each option's rules in full: docs/optimizer.md; its summary: ``dmuon.options.table``):
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or group
            dicts. A group's ``use_muon`` picks the algorithm; without it, ndim >= 2
            parameters go to Muon unless named like an embedding or output head
            (``DEFAULT_ADAMW_NAME_PATTERN``). A group may set the options from ``lr`` to
            ``momentum_dtype``; for its AdamW part ``adamw_<x>`` wins over ``<x>``.
        lr: Muon's learning rate (AdamW's too unless ``adamw_lr``); a float or a
            one-element Tensor. The options after it are keyword-only.
        momentum, nesterov, weight_decay: Muon's momentum EMA, Nesterov look-ahead and
            decoupled decay (``p *= 1 - lr * weight_decay``).
        ns_steps, ns_coefficients, eps, ns_algorithm, ns_gram_restarts: the Newton-Schulz
            iteration, the norm floor before it, and Gram Newton-Schulz with its restarts.
        adjust_lr, matched_adamw_rms: the shape scale and the RMS ``"match_rms_adamw"`` aims at.
        split_rows: orthogonalize each block of this many rows on its own (a head).
        normuon, normuon_beta2: NorMuon's row-normalized update and its EMA coefficient.
        cautious_weight_decay: decay only where update and weight agree in sign.
        qk_clip_threshold: QK-clip (``dmuon.attention.qk_clip``); None: off. Needs the attentions
            registered with :meth:`clip_attention` and reporting to :attr:`max_logits`.
        momentum_dtype: how the momentum is kept between steps: None (the parameter's dtype),
            ``torch.bfloat16`` / ``"bfloat16"``, or ``"int8"`` (``dmuon.state.kept_state``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW part.
        adamw_state_dtype: how the AdamW part keeps its moments of a parameter of 2 or more dims
            between steps: None (the parameter's dtype), ``"bfloat16"`` or ``"int8"`` (its
            second moment as the int8 of its square root; ``dmuon.state.kept_state``).
        comm, max_batch_numel: the owner-computed fast path or the reference path, and the
            fast path's matrix elements a rank owns per batch (its scratch bound).
        split_replicas, link_gbps, replica_link_gbps: under HSDP, spread Newton-Schulz over
            every replica, or not, or let the cost model choose from the links' Gbit/s.
        ns_dtype: what Newton-Schulz multiplies in; every choice is exact across world sizes.
        telemetry: record each step's figures, read with :meth:`telemetry`.
        skip_nonfinite: a step with a NaN or inf grad on any rank changes nothing anywhere.
        foreach, fused, capturable: torch.optim's flags, also group keys (capturable: ``lr``
            and ``weight_decay`` as device tensors, for ``dmuon.capture.cuda_graphs``).
        maximize, differentiable (also group keys): no such path in DMuon: False or None only.
    """

    def __init__(
        self,
        params: ParamsArg,
        lr: float | torch.Tensor = D["lr"],
        *,
        momentum: float = D["momentum"],
        nesterov: bool = D["nesterov"],
        weight_decay: float = D["weight_decay"],
        ns_steps: int = D["ns_steps"],
        ns_coefficients: str | Sequence[float] = D["ns_coefficients"],
        ns_algorithm: str = D["ns_algorithm"],
        ns_gram_restarts: Sequence[int] = D["ns_gram_restarts"],
        eps: float = D["eps"],
        adjust_lr: str | None = D["adjust_lr"],
        matched_adamw_rms: float = D["matched_adamw_rms"],
        adamw_lr: float | None = D["adamw_lr"],
        adamw_betas: tuple[float, float] = D["adamw_betas"],
        adamw_eps: float = D["adamw_eps"],
        adamw_weight_decay: float | None = D["adamw_weight_decay"],
        adamw_state_dtype: str | torch.dtype | None = D["adamw_state_dtype"],
        split_rows: int | None = D["split_rows"],
        normuon: bool = D["normuon"],
        normuon_beta2: float = D["normuon_beta2"],
        cautious_weight_decay: bool = D["cautious_weight_decay"],
        qk_clip_threshold: float | None = D["qk_clip_threshold"],
        momentum_dtype: str | torch.dtype | None = D["momentum_dtype"],
        comm: str = D["comm"],
        max_batch_numel: int = D["max_batch_numel"],
        split_replicas: bool | None = D["split_replicas"],
        ns_dtype: str | torch.dtype = D["ns_dtype"],
        link_gbps: float = D["link_gbps"],
        replica_link_gbps: float = D["replica_link_gbps"],
        telemetry: bool = D["telemetry"],
        skip_nonfinite: bool = D["skip_nonfinite"],
        foreach: bool | None = D["foreach"],
        fused: bool | None = D["fused"],
        maximize: bool | None = D["maximize"],
        capturable: bool | None = D["capturable"],
        differentiable: bool | None = D["differentiable"],
    ) -> None:
        # Every option by name (each is a keyword above; the table holds its default and check).
        given = {name: value for name, value in locals().items() if name in D}
        if isinstance(params, (set, frozenset)):
            # A set's order differs between processes: ranks would plan differently.
            raise TypeError("DMuon: params must be an ordered collection (list), not a set")
        muon_defaults, adamw_defaults = split_options(given)
        check_group(dict(muon_defaults), True, "DMuon")  # before any group is built
        check_group(dict(adamw_defaults), False, "DMuon (AdamW part)")
        self._muon_defaults, self._adamw_defaults = muon_defaults, adamw_defaults
        whole = check_optimizer_options(given)
        self.foreach, self.fused, self.capturable = check_optimizer_flags(given, adamw_defaults["lr"])
        for name in OPTIMIZER_ATTRIBUTES:  # the whole optimizer's options (the flags: above)
            if name in whole:
                setattr(self, name, whole[name])
        self._names: dict[torch.Tensor, str] = {}
        self._groups_added = 0  # groups as the user wrote them, before any split
        self.start_afresh(whole["telemetry"])
        # The options a group may set (comm, ns_dtype and the rest are the whole optimizer's).
        super().__init__(params, dict(muon_defaults, **{name: given[name] for name in ADAMW_ALIASES}))
        attach_hooks(self)  # load_state_dict keeps the options; state_dict settles the last step

    def start_afresh(self, telemetry: bool) -> None:
        """The step's phases with measurements from zero, and no paths or plan yet (made at the
        first step): at construction, and on a copy (``dmuon.state.pickling``)."""
        fast_path = FastPath(self.comm, self.max_batch_numel, self.split_replicas, self.ns_dtype,
                             self.link_gbps, self.replica_link_gbps)
        self.phases = StepPhases(fast_path, Telemetry(telemetry))

    @property
    def comm_stats(self) -> CommStats:
        """Bytes and collectives of the fast path since construction."""
        return self.phases.comm_stats

    @property
    def scratch_stats(self) -> ScratchMeter:
        """Live and peak bytes of the fast path's scratch (the peak reset each step)."""
        return self.phases.scratch_stats

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; one without ``use_muon`` is split into a Muon and an AdamW group
        (``dmuon.options.param_groups.build_param_groups``)."""
        built = build_param_groups(param_group, self._groups_added, self.param_groups, self._muon_defaults,
                                   self._adamw_defaults,
                                   {"foreach": self.foreach, "fused": self.fused, "capturable": self.capturable})
        self._groups_added += 1
        for names, group in built:
            self._names.update(zip(group["params"], names))
            self.param_groups.append(group)
        self.phases.forget_plan()

    def clip_attention(self, name: str, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: AttentionHeads) -> None:
        """Watch one attention for QK-clip (``dmuon.attention.clipping``); every rank registers
        the same ones."""
        self.phases.attention_clip.add(name, q_weight, k_weight, heads, self.param_name)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """The five phases of ``dmuon.step.phases``, in order."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        place_on_device(self.param_groups)  # capturable: lr and weight_decay where the step reads them
        options = StepOptions(self.ns_dtype, self.skip_nonfinite, self.foreach, self.fused)
        device = local_of(self.param_groups[0]["params"][0]).device  # the step's small tensors' (a DTensor's shard's)
        phases = self.phases
        step = phases.prepare(self.param_groups, self.state, self.param_name, device, options)
        step.check_locally()
        step.agree()
        step.wait()
        step.compute_and_apply()
        step.report()
        return loss

    # ------------------------------------------------------------ read-only queries
    # None of them runs a collective: each is safe to call on one rank only (logging code).

    @property
    def max_logits(self) -> MaxLogitTracker:
        """Where the model reports attention logits for QK-clip (``dmuon.attention.max_logits``)."""
        return self.phases.attention_clip.tracker

    def last_max_logits(self) -> dict[str, torch.Tensor]:
        """Each attention's per-head largest logit of the last step, before clipping."""
        return self.phases.attention_clip.last_max_logits()

    def param_name(self, param: torch.Tensor) -> str:
        """The name a parameter was given (or its group position)."""
        return self._names.get(param, "<unnamed parameter>")

    def comm_paths(self) -> dict[str, str]:
        """Name -> path (``local``, ``all_to_all`` or ``redistribute``) of every Muon parameter."""
        return {self.param_name(p): path for p, path in self.phases.paths(self.param_groups, self.param_name).items()}

    @property
    def skipped_steps(self) -> int:
        """Steps ``skip_nonfinite`` skipped, counted when the next ``step()`` or
        ``state_dict()`` reads them."""
        return self.phases.grad_status.skipped_steps

    def telemetry(self) -> StepFigures | None:
        """The last step's figures (``dmuon.step.telemetry``), None if off or before a step;
        local to this rank."""
        figures = self.phases.telemetry.last_step()
        return None if figures is None else figures.with_skipped(self.skipped_steps)

    def state_bytes(self) -> StateBytes:
        """This rank's optimizer state in bytes, Muon's and AdamW's, beside their parameters'
        local elements (``dmuon.step.telemetry.StateBytes``)."""
        return state_bytes(self.param_groups, self.state)

    def owner_plans(self) -> list[OwnerPlan]:
        """The fast path's plan of each mesh (made at the first ``step()``; empty before)."""
        run = self.phases.fast_path.owner_run
        return [] if run is None else [run.plan]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, but Muon's state and the AdamW part's kept moments keep their saved dtypes, a
        capturable group its state tensors (``dmuon.state.loading``) and its device
        hyperparameters (``dmuon.options.device_hyperparameters``), and the plan is made anew."""
        held, tensors = held_values(self.param_groups), state_tensors(self)
        super().load_state_dict(state_dict)
        keep_saved_dtypes(self, state_dict, (*MUON_STATE_KEYS, *(k for keys in ADAMW_MOMENTS for k in keys.keys)))
        convert_loaded(self.param_groups, self.state, self.param_name)  # a checkpoint of another momentum_dtype
        self.phases.momentum_dtypes.settle(self.param_groups)
        keep_after_load(self.param_groups, held)  # capturable: the loaded values in the groups' own device tensors
        keep_state_tensors(self, tensors)  # capturable: the loaded state in the tensors a captured step reads
        self.phases.forget_plan()

