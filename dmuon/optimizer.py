"""DMuon: Muon for matrices, AdamW for the rest, native to DTensor/FSDP2.

One ``step()``:

1. every rank agrees, with one small ``all_reduce`` per mesh, on which distributed
   Muon parameters have a grad (and whether any rank found an invalid grad);
2. each matrix is orthogonalized once: on its owner rank, batch by batch
   (``all_to_all`` fast path, ``dmuon.transport.owner_exchange``), on every rank (``redistribute``
   reference path), or where it lives (``local``: plain tensors, replicas); momentum
   runs on the local shards just before, and weight decay and the scaled update land
   on them just after, so scratch memory is bounded per batch (or per parameter);
3. AdamW groups take a ``torch.optim.AdamW`` step.

The collectives a rank runs depend only on the parameters and on the agreed grad
set, never on local values, so ranks cannot fall out of step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer

from dmuon.comm import CommStats, ScratchMeter, mesh_device
from dmuon.cost_model import CostModel, plan_with_best_split
from dmuon.grad_agreement import agree_on_grads, grad_problem
from dmuon.newton_schulz import (
    DEFAULT_NS_DTYPE,
    DEFAULT_NS_EPS,
    DEFAULT_NS_STEPS,
    KELLER_COEFFICIENTS,
    matrix_shape,
    newton_schulz_flops,
    orthogonalize,
    resolve_ns_dtype,
)
from dmuon.transport.local import orthogonalize_local
from dmuon.transport.owner_exchange import run_owner_plan
from dmuon.transport.reference import orthogonalize_gathered
from dmuon.param_groups import build_param_groups, check_adamw_hyperparameters, check_muon_hyperparameters, check_ns_dtype
from dmuon.plan import (
    ALL_TO_ALL,
    COMM_CHOICES,
    DEFAULT_BATCH_NUMEL,
    LOCAL,
    REDISTRIBUTE,
    OwnerPlan,
    ParamSpec,
    comm_path,
    make_owner_plan,
    layout_of,
)
from dmuon.telemetry import StepFigures, Telemetry
from dmuon.torch_compat import compute_local_shape_and_global_offset, scalar_dtype
from dmuon.update_rules import DEFAULT_MATCHED_ADAMW_RMS, adamw_step_, apply_muon_update_, muon_momentum_, shape_scale

logger = logging.getLogger("dmuon")

# The paths that orthogonalize one whole parameter at a time (the owner exchange runs
# every fast-path parameter together, from its plan).
WHOLE_TENSOR_TRANSPORTS = {LOCAL: orthogonalize_local, REDISTRIBUTE: orthogonalize_gathered}

ParamsArg = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]

# What a pickle or deepcopy of a DMuon keeps besides torch's defaults, state and
# param_groups: its configuration. The paths and owner plans are derived from the
# parameters (and a plan holds process groups, which do not pickle): the copy rebuilds
# them at its first step. Its measurements (comm_stats, scratch_stats, telemetry) start afresh.
PICKLED_ATTRIBUTES = (
    "_muon_defaults", "_adamw_defaults", "_names", "_groups_added", "comm", "max_batch_numel", "split_replicas",
    "ns_dtype",
)
# The key under which a pickle keeps ``telemetry``. It also tells __setstate__ that it
# makes a copy: load_state_dict calls it too, with only state and param_groups.
TELEMETRY_STATE_KEY = "telemetry_enabled"


@dataclass
class _FastPlan:
    """The fast-path Muon parameters, their owner plan, and the ranks that run it."""

    group: dist.ProcessGroup
    """Every rank of the parameters' meshes (plan rank = rank in this group)."""
    rank: int
    params: list[torch.Tensor]
    plan: OwnerPlan
    device: torch.device
    """Where this rank's buffers live (the meshes' device)."""


class DMuon(Optimizer):
    """Distributed Muon with an AdamW fallback, for plain tensors and DTensors.

    Args:
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``),
            or param-group dicts; as in torch.optim, either every parameter has a name or
            none has, and the names are kept in each group's ``param_names``. A group's
            ``use_muon`` key picks the algorithm; a group without it is split: ndim >= 2
            parameters go to Muon unless their name marks an embedding or output head
            (see ``DEFAULT_ADAMW_NAME_PATTERN``), the rest to AdamW. A group may set any
            key of ``defaults``: the options from ``lr`` to ``split_rows`` (``comm`` and
            those after it are the whole optimizer's). For a group's AdamW parameters
            ``adamw_<x>`` wins over ``<x>`` (``adamw_lr`` over ``lr``), as in the
            constructor; a ``use_muon=True`` group refuses the ``adamw_*`` keys.
        lr: Muon learning rate (also AdamW's unless ``adamw_lr`` is set): a float or a
            one-element Tensor of any shape (used as torch.optim.Muon and AdamW use one).
            The options after it are keyword-only.
        momentum: Muon's EMA momentum coefficient.
        nesterov: use the Nesterov look-ahead ``lerp(grad, buf, momentum)``.
        weight_decay: decoupled weight decay, applied as ``p *= 1 - lr * weight_decay``.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: ``(a, b, c)`` of the quintic iteration, or a name from
            ``dmuon.NS_COEFFICIENT_SETS``.
        eps: floor of the Frobenius norm before Newton-Schulz.
        adjust_lr: shape-aware scale of Muon's step: ``"original"``
            (``sqrt(max(1, A/B))``), ``"match_rms_adamw"``
            (``matched_adamw_rms * sqrt(max(A, B))``), ``"spectral"`` (``sqrt(A/B)``)
            or ``None`` (no scaling).
        matched_adamw_rms: the update RMS ``"match_rms_adamw"`` targets.
        split_rows: orthogonalize each block of this many consecutive rows of a 2-D
            parameter on its own (one attention head of ``wq``/``wk``/``wv``); the shape
            scale then uses the block's shape. None: the whole matrix.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW part;
            ``adamw_lr`` and ``adamw_weight_decay`` default to ``lr`` and ``weight_decay``.
        comm: ``"all_to_all"`` (owner-computed fast path where the placement allows it)
            or ``"redistribute"`` (reference path: every rank gathers and
            orthogonalizes every distributed matrix).
        max_batch_numel: elements of travelling matrices a rank owns in one batch of
            the fast path, unless one matrix is larger; bounds the scratch memory
            (``OwnerPlan.peak_scratch_bytes``).
        split_replicas: for parameters replicated over some mesh dims (HSDP's
            ``dp_replicate``): True spreads Newton-Schulz over every rank of every
            replica (each rank orthogonalizes ~1/(R*S) of the matrices; results travel
            to the other replicas), False keeps each replica to itself (each rank
            does ~1/S, as FSDP2 Muon does, nothing crosses replicas), None lets the
            cost model (``dmuon.cost_model.plan_with_best_split``) choose.
        ns_dtype: what Newton-Schulz multiplies in: ``"bfloat16"`` (Muon's usual
            choice, torch.optim.Muon's bits), ``"float32"`` (for CPUs without a native
            bf16 matmul, where bf16 is ~50x slower), or ``"auto"``: bfloat16 on
            accelerators and on CPUs with one, float32 elsewhere
            (``dmuon.newton_schulz.native_bf16_matmul``, decided per process). Updates
            travel and results come back in bf16 whatever it is, so every choice is
            exact across world sizes.
        telemetry: record each step's times, bytes and update/weight RMS, read with
            :meth:`telemetry` (``dmuon.telemetry``; adds one small ``all_reduce`` per step).

    Non-finite gradients are not filtered: like ``torch.optim.Muon``, a NaN or inf in a
    matrix's gradient makes that whole matrix (every shard of it) non-finite after the
    step, and the momentum buffer keeps it. Ranks stay in step all the same. Clip or
    skip such steps upstream (TorchTitan's ``clip_grad_norm_`` reports the norm).
    """

    def __init__(
        self,
        params: ParamsArg,
        lr: float | torch.Tensor = 0.02,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_coefficients: str | Sequence[float] = KELLER_COEFFICIENTS,
        eps: float = DEFAULT_NS_EPS,
        adjust_lr: str | None = "original",
        matched_adamw_rms: float = DEFAULT_MATCHED_ADAMW_RMS,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        split_rows: int | None = None,
        comm: str = ALL_TO_ALL,
        max_batch_numel: int = DEFAULT_BATCH_NUMEL,
        split_replicas: bool | None = None,
        ns_dtype: str | torch.dtype = DEFAULT_NS_DTYPE,
        telemetry: bool = False,
    ) -> None:
        if isinstance(params, (set, frozenset)):
            # A set's order differs between processes: ranks would plan differently.
            raise TypeError("DMuon: params must be an ordered collection (list), not a set")
        if comm not in COMM_CHOICES:
            raise ValueError(f"DMuon: unknown comm {comm!r}; use one of {COMM_CHOICES}")
        if not isinstance(max_batch_numel, int) or max_batch_numel < 1:
            raise ValueError(f"DMuon: max_batch_numel must be a positive int, got {max_batch_numel!r}")
        if split_replicas not in (None, True, False):
            raise ValueError(f"DMuon: split_replicas must be True, False or None (let the cost model decide), "
                             f"got {split_replicas!r}")
        muon_defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            eps=eps,
            adjust_lr=adjust_lr,
            matched_adamw_rms=matched_adamw_rms,
            split_rows=split_rows,
        )
        adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr,
            betas=adamw_betas,
            eps=adamw_eps,
            weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        )
        # Validate the defaults once, so a bad option is reported as such even before
        # any group is built.
        check_muon_hyperparameters(dict(muon_defaults), "DMuon")
        check_adamw_hyperparameters(dict(adamw_defaults), "DMuon (AdamW part)")
        self._muon_defaults = muon_defaults
        self._adamw_defaults = adamw_defaults
        self.comm = comm
        self.max_batch_numel = max_batch_numel
        self.split_replicas = split_replicas
        self.ns_dtype = check_ns_dtype(ns_dtype)
        self._names: dict[torch.Tensor, str] = {}
        self._groups_added = 0  # groups as the user wrote them, before any split
        self._start_afresh(telemetry)
        # The options a group may set (comm, ns_dtype and the rest are the whole optimizer's).
        defaults = dict(muon_defaults, adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                        adamw_weight_decay=adamw_weight_decay)
        super().__init__(params, defaults)

    def _start_afresh(self, telemetry: bool) -> None:
        """Measurements from zero, and no paths or plans yet (made at the first step)."""
        self.comm_stats = CommStats()
        """Bytes and collectives of the fast path since construction."""
        self.scratch_stats = ScratchMeter()
        """Live and peak bytes of the fast path's scratch; the peak is reset each step."""
        self._telemetry = Telemetry(telemetry)
        self._fast_plans: list[_FastPlan] | None = None
        self._paths: dict[torch.Tensor, str] | None = None

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in PICKLED_ATTRIBUTES})
        state[TELEMETRY_STATE_KEY] = self._telemetry.enabled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        telemetry = state.pop(TELEMETRY_STATE_KEY, None)
        super().__setstate__(state)
        # torch's __setstate__ (also run by load_state_dict) adds differentiable=False to
        # defaults; DMuon has no such option, and defaults stay the keys a group may set.
        self.defaults.pop("differentiable", None)
        if telemetry is not None:  # a copy, not load_state_dict: nothing derived came with it
            self._start_afresh(telemetry)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; one without ``use_muon`` is split into a Muon and an AdamW group
        (``dmuon.param_groups.build_param_groups``)."""
        built = build_param_groups(param_group, self._groups_added, self.param_groups, self._muon_defaults,
                                   self._adamw_defaults)
        self._groups_added += 1
        for names, group in built:
            self._names.update(zip(group["params"], names))
            self.param_groups.append(group)
        # Paths and plans cover every Muon parameter: rebuild them.
        self._paths, self._fast_plans = None, None

    def param_name(self, param: torch.Tensor) -> str:
        """The name a parameter was given (or its group position)."""
        return self._names.get(param, "<unnamed parameter>")

    def comm_paths(self) -> dict[str, str]:
        """Name -> path (``local``, ``all_to_all`` or ``redistribute``) of every Muon parameter.

        A pure query (no collective): safe to call on one rank only, e.g. in logging code.
        """
        return {self.param_name(p): path for p, path in self._ensure_paths().items()}

    def telemetry(self) -> StepFigures | None:
        """The last step's figures (``dmuon.telemetry``), or ``None`` if telemetry is off
        or no step ran yet. Local to this rank: safe to call on any subset of ranks."""
        return self._telemetry.last_step()

    def owner_plans(self) -> list[OwnerPlan]:
        """The fast path's plan of each mesh (made at the first ``step()``; empty before)."""
        return [fast.plan for fast in self._fast_plans or ()]

    # ------------------------------------------------------------------ planning

    def _ensure_paths(self) -> dict[torch.Tensor, str]:
        """Each Muon parameter's path, from its type and placement alone (no collective)."""
        if self._paths is not None:
            return self._paths
        paths: dict[torch.Tensor, str] = {}
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for param in group["params"]:
                try:
                    paths[param] = comm_path(param, self.comm)
                except ValueError as error:
                    raise ValueError(f"DMuon: parameter {self.param_name(param)!r}: {error}") from None
        # One plan serves the fast path, over the ranks of the first fast parameter's
        # mesh; a parameter on a mesh of other ranks takes the reference path.
        fast = [p for p, path in paths.items() if path == ALL_TO_ALL]
        for param in fast[1:]:
            if _mesh_ranks(param.device_mesh) != _mesh_ranks(fast[0].device_mesh):
                paths[param] = REDISTRIBUTE
        self._paths = paths
        return paths

    def _ensure_plans(self) -> list[_FastPlan]:
        """Plan the fast path, once, at the first step.

        Every rank runs this at the same point (its first ``step()``), so the one
        collective it needs (checking that local shards are where the plan thinks) is
        matched on every rank. Queries such as :meth:`comm_paths` never plan.
        """
        if self._fast_plans is not None:
            return self._fast_plans
        members = [(p, g) for g in self.param_groups if g["use_muon"] for p in g["params"]
                   if self._ensure_paths()[p] == ALL_TO_ALL]
        plans = []
        if members:
            ranks = _mesh_ranks(members[0][0].device_mesh)
            group = _group_of(ranks, [p.device_mesh for p, _ in members])
            plan_rank = {r: dist.get_group_rank(group, r) for r in ranks}
            specs = [ParamSpec(tuple(p.shape), ns_steps=g["ns_steps"], split_rows=g["split_rows"],
                               layout=layout_of(p, plan_rank)) for p, g in members]
            device = mesh_device(members[0][0].device_mesh)
            if self.split_replicas is None:
                cost = CostModel(ns_dtype=resolve_ns_dtype(self.ns_dtype, device.type))
                plan, split = plan_with_best_split(specs, len(ranks), self.max_batch_numel, cost)
                if any(spec.layout.has_replicas for spec in specs):
                    logger.info("DMuon: the cost model %s Newton-Schulz across replicas (split_replicas=None)",
                                "splits" if split else "does not split")
            else:
                plan = make_owner_plan(specs, len(ranks), self.max_batch_numel, self.split_replicas)
            params = [p for p, _ in members]
            fast = _FastPlan(group, plan_rank[dist.get_rank()], params, plan, device)
            self._check_shards_agree_with_plan(fast)
            plans.append(fast)
        self._fast_plans = plans
        for path in (ALL_TO_ALL, REDISTRIBUTE, LOCAL):
            names = [self.param_name(p) for p, chosen in self._paths.items() if chosen == path]
            if names:
                logger.info("DMuon: %d Muon parameter(s) use the %s path: %s", len(names), path, ", ".join(names))
        return plans

    def _check_shards_agree_with_plan(self, fast: _FastPlan) -> None:
        """Every rank's local shard must be the block of the parameter the plan assumes.

        The plan reads DTensor's placement rules (``dmuon.layout``); here each rank
        compares them with DTensor's own answer and with the local tensor's shape, so
        one built by ``DTensor.from_local`` with custom uneven shards is caught. The
        check is one ``all_reduce`` at planning time, so a mismatch on any rank stops
        every rank.
        """
        wrong = []
        for param, spec in zip(fast.params, fast.plan.params):
            box = spec.layout.boxes(spec.shape)[fast.rank]
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            expected_offsets = [start for start, length in box if length]
            offsets = [o for o, (_, length) in zip(offset, box) if length]
            sizes = tuple(length for _, length in box)
            if sizes != tuple(shape) or sizes != tuple(param.to_local().shape) or offsets != expected_offsets:
                wrong.append(param)
        count = torch.tensor([len(wrong)], dtype=torch.int32, device=fast.device)
        dist.all_reduce(count, group=fast.group)
        if count.item():
            mine = f" here: {[self.param_name(p) for p in wrong]}" if wrong else ""
            raise ValueError(
                f"DMuon: {count.item()} sharded parameter shard(s) are not the blocks their placements "
                f"describe{mine}. Shard them with FSDP2 or distribute_tensor, or pass use_muon=False for them."
            )

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_paths()
        fast_plans = self._ensure_plans()
        self._telemetry.begin_step(_local(self.param_groups[0]["params"][0]).device, self.comm_stats.bytes_sent)
        grads = self._checked_grads()
        self.scratch_stats.reset_peak()
        for fast in fast_plans:
            self._owner_computed(fast, grads)
        for group in self.param_groups:
            for param in group["params"] if group["use_muon"] else ():
                path = self._paths[param]
                if param in grads and path != ALL_TO_ALL:
                    self._whole_tensor_step(param, grads[param], group, path)
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group_step(group)
        self._telemetry.end_step(self.comm_stats.bytes_sent)
        return loss

    def _checked_grads(self) -> dict[torch.Tensor, torch.Tensor]:
        """Check every grad and agree on the grad set; then return each Muon parameter's
        grad, laid out like the parameter. Nothing is modified before the checks pass,
        so a rejected step leaves parameters and state as they were."""
        problems: dict[torch.Tensor, str] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    problem = grad_problem(param, group["use_muon"])
                    if problem:
                        problems[param] = problem
        agree_on_grads(self._distributed_by_mesh(), problems, self.param_name)
        grads: dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            for param in group["params"] if group["use_muon"] else ():
                grad = param.grad
                if grad is None:
                    continue
                if isinstance(param, DTensor) and grad.placements != param.placements:
                    # A collective; safe here: every rank agreed this grad exists.
                    grad = grad.redistribute(param.device_mesh, param.placements)
                grads[param] = grad
                if "momentum_buffer" not in self.state[param]:
                    self.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return grads

    def _distributed_by_mesh(self) -> dict[DeviceMesh, list[torch.Tensor]]:
        """DTensor Muon parameters by mesh: their step may run collectives, so every
        rank of the mesh must agree on their grads (whatever their path)."""
        by_mesh: dict[DeviceMesh, list[torch.Tensor]] = {}
        for param in self._ensure_paths():
            if isinstance(param, DTensor) and param.device_mesh.size() > 1:
                by_mesh.setdefault(param.device_mesh, []).append(param)
        return by_mesh

    def _owner_computed(self, fast: _FastPlan, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """The fast path: see ``dmuon.transport.owner_exchange`` for the schedule."""
        params = fast.params
        groups = {p: g for g in self.param_groups if g["use_muon"] for p in g["params"]}
        local_grads = {j: _local(grads[p]) for j, p in enumerate(params) if p in grads}
        local_bufs = {j: _local(self.state[params[j]]["momentum_buffer"]) for j in local_grads}
        local_params = {j: _local(params[j]) for j in local_grads}

        def update_block(j: int, lo: int, hi: int, shape: tuple[int, int]) -> torch.Tensor:
            group = groups[params[j]]
            update = muon_momentum_(local_grads[j][lo:hi], local_bufs[j][lo:hi], group["momentum"], group["nesterov"])
            return update.view(shape)

        def orthogonalize_unit(j: int, matrix: torch.Tensor) -> torch.Tensor:
            return self._orthogonalize(matrix, groups[params[j]])

        def apply_block(j: int, lo: int, hi: int, ortho: torch.Tensor) -> None:
            self._apply(params[j], local_params[j][lo:hi].view(ortho.shape), ortho, groups[params[j]])

        run_owner_plan(
            fast.plan, local_grads.keys(), group=fast.group, rank=fast.rank, device=fast.device,
            update_block=update_block, orthogonalize=orthogonalize_unit, apply_block=apply_block,
            stats=self.comm_stats, meter=self.scratch_stats,
        )

    def _whole_tensor_step(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], path: str) -> None:
        """Momentum, Newton-Schulz and update of one parameter that is whole on this rank
        (``local``) or gathered whole on every rank (``redistribute``): see ``dmuon.transport``."""
        update = muon_momentum_(_local(grad), _local(self.state[param]["momentum_buffer"]), group["momentum"],
                                group["nesterov"])
        ortho = WHOLE_TENSOR_TRANSPORTS[path](update, param, lambda full: self._orthogonalize_whole(full, group))
        self._apply(param, _local(param), ortho, group)

    def _orthogonalize_whole(self, tensor: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Newton-Schulz of a whole parameter-shaped tensor: its matrix, each expert of a
        stack, or each block of ``split_rows`` rows."""
        matrix = tensor.view(matrix_shape(tensor.shape))
        if group["split_rows"]:
            blocks = [self._orthogonalize(block, group) for block in matrix.split(group["split_rows"])]
            return torch.cat(blocks).view(tensor.shape)
        return self._orthogonalize(matrix, group).view(tensor.shape)

    def _orthogonalize(self, matrix: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Newton-Schulz with the group's settings; counts the flops run on this rank."""
        self.comm_stats.ns_flops += newton_schulz_flops(matrix.shape, group["ns_steps"])
        with self._telemetry.newton_schulz():
            dtype = resolve_ns_dtype(self.ns_dtype, matrix.device.type)
            return orthogonalize(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)

    def _apply(self, param: torch.Tensor, target: torch.Tensor, ortho: torch.Tensor, group: dict[str, Any]) -> None:
        # With split_rows, each block is its own matrix for the shape scale too.
        shape = (group["split_rows"], param.shape[1]) if group["split_rows"] else param.shape
        scale = shape_scale(shape, group["adjust_lr"], group["matched_adamw_rms"])
        with self._telemetry.muon_update(target):
            apply_muon_update_(target, ortho, group["lr"], group["weight_decay"], scale)

    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            with self._telemetry.adamw_update([_local(p) for p in params]):
                adamw_step_(
                    params, grads, exp_avgs, exp_avg_sqs, steps,
                    lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                    has_complex=any(p.is_complex() for p in params),
                )


def _mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of a mesh, sorted."""
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _group_of(ranks: tuple[int, ...], meshes: Sequence[DeviceMesh]) -> dist.ProcessGroup:
    """A process group of exactly ``ranks``: the default group or a 1-D mesh's group when
    one has them, else a new group made once per rank set. Only the member ranks take
    part in making it (``use_local_synchronization``), so pipeline stages, each with
    its own optimizer and ranks, need not make theirs together."""
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    for mesh in meshes:
        if mesh.ndim == 1 and _mesh_ranks(mesh) == ranks:
            return mesh.get_group()
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[ranks]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own data: the local shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
