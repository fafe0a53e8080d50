"""DMuon: Muon for matrices, AdamW for the rest, native to DTensor/FSDP2.

One ``step()``:

1. every rank agrees, with one small ``all_reduce`` per mesh, on which distributed
   Muon parameters have a grad (and whether any rank found an invalid grad);
2. momentum and Nesterov run on the local shards;
3. each matrix is orthogonalized once, on its owner rank (``all_to_all`` fast path),
   on every rank (``redistribute`` reference path), or locally (plain tensors);
4. weight decay and the scaled update land on the local shards;
5. AdamW groups take a ``torch.optim.AdamW`` step.

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
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.optim.optimizer import Optimizer, _get_scalar_dtype

from dmuon.comm import CommStats, Exchange, pack_gather, pack_scatter, unpack_gather, unpack_scatter
from dmuon.newton_schulz import DEFAULT_NS_EPS, DEFAULT_NS_STEPS, KELLER_COEFFICIENTS, matrix_shape, orthogonalize
from dmuon.param_groups import (
    ADAMW_KEYS,
    MUON_KEYS,
    check_adamw_hyperparameters,
    check_muon_hyperparameters,
    check_muon_param,
    default_use_muon,
)
from dmuon.plan import (
    ALL_TO_ALL,
    COMM_CHOICES,
    DEFAULT_BATCH_NUMEL,
    LOCAL,
    REDISTRIBUTE,
    OwnerPlan,
    comm_path,
    make_owner_plan,
)
from dmuon.update_rules import DEFAULT_MATCHED_ADAMW_RMS, adamw_step_, apply_muon_update_, muon_momentum_, shape_scale

logger = logging.getLogger("dmuon")

ParamsArg = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]


@dataclass
class _MeshPlan:
    """The fast-path Muon parameters of one 1-D mesh and their owner plan."""

    mesh: DeviceMesh
    params: list[torch.Tensor]
    plan: OwnerPlan


@dataclass
class _MuonWork:
    """One Muon parameter during a step."""

    param: torch.Tensor
    group: dict[str, Any]
    update: torch.Tensor
    """Local bf16 rows of the tensor to orthogonalize (the whole tensor if local)."""


class DMuon(Optimizer):
    """Distributed Muon with an AdamW fallback, for plain tensors and DTensors.

    Args:
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``),
            or param-group dicts. A group's ``use_muon`` key picks the algorithm; a group
            without it is split: ndim >= 2 parameters go to Muon unless their name marks
            an embedding or output head (see ``DEFAULT_ADAMW_NAME_PATTERN``), the rest
            to AdamW.
        lr: Muon learning rate (also AdamW's unless ``adamw_lr`` is set).
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
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW part;
            ``adamw_lr`` and ``adamw_weight_decay`` default to ``lr`` and ``weight_decay``.
        comm: ``"all_to_all"`` (owner-computed fast path where the placement allows it)
            or ``"redistribute"`` (reference path: every rank gathers and
            orthogonalizes every distributed matrix).
        max_batch_numel: matrix elements per communication batch (bounds buffers).

    Non-finite gradients are not filtered: like ``torch.optim.Muon``, a NaN or inf in a
    matrix's gradient makes that whole matrix (every shard of it) non-finite after the
    step, and the momentum buffer keeps it. Ranks stay in step all the same. Clip or
    skip such steps upstream (TorchTitan's ``clip_grad_norm_`` reports the norm).
    """

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 0.02,
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
        *,
        comm: str = ALL_TO_ALL,
        max_batch_numel: int = DEFAULT_BATCH_NUMEL,
    ) -> None:
        if isinstance(params, (set, frozenset)):
            # A set's order differs between processes: ranks would plan differently.
            raise TypeError("DMuon: params must be an ordered collection (list), not a set")
        if comm not in COMM_CHOICES:
            raise ValueError(f"DMuon: unknown comm {comm!r}; use one of {COMM_CHOICES}")
        if not isinstance(max_batch_numel, int) or max_batch_numel < 1:
            raise ValueError(f"DMuon: max_batch_numel must be a positive int, got {max_batch_numel!r}")
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
        self.comm_stats = CommStats()
        """Bytes and collectives of the fast path since construction."""
        self._names: dict[torch.Tensor, str] = {}
        self._groups_added = 0  # groups as the user wrote them, before any split
        self._mesh_plans: list[_MeshPlan] | None = None
        self._paths: dict[torch.Tensor, str] = {}
        # Muon parameters whose path runs collectives, by mesh: what ranks must agree on.
        self._distributed_by_mesh: dict[DeviceMesh, list[torch.Tensor]] = {}
        defaults = dict(muon_defaults, adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                        adamw_weight_decay=adamw_weight_decay, comm=comm)
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; one without ``use_muon`` is split into a Muon and an AdamW group."""
        if not isinstance(param_group, dict):
            raise TypeError(f"DMuon: a param group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("DMuon: a param group needs a 'params' entry")
        raw = param_group["params"]
        if isinstance(raw, torch.Tensor):
            raw = [raw]
        elif isinstance(raw, set):
            raise TypeError("DMuon: params must be an ordered collection (list), not a set")
        user_group = self._groups_added
        self._groups_added += 1
        named = [self._name_param(item, user_group, i) for i, item in enumerate(raw)]
        if not named:
            raise ValueError(f"DMuon: param group {user_group} is empty")
        in_other_groups = {id(p) for group in self.param_groups for p in group["params"]}
        seen: set[int] = set()
        for name, param in named:
            if id(param) in in_other_groups:
                raise ValueError(f"DMuon: parameter {name!r} appears in more than one param group")
            if id(param) in seen:
                raise ValueError(f"DMuon: parameter {name!r} appears twice in param group {user_group}")
            seen.add(id(param))
        options = {k: v for k, v in param_group.items() if k != "params"}
        use_muon = options.pop("use_muon", None)
        where = f"DMuon param group {user_group}"
        if use_muon is None:
            # Split by the default routing; each half takes the options it knows
            # (shared keys such as lr and weight_decay go to both).
            unknown = set(options) - set(MUON_KEYS) - set(ADAMW_KEYS) - {"initial_lr"}
            if unknown:
                raise ValueError(f"{where}: unknown option(s) {sorted(unknown)}; known: {sorted(set(MUON_KEYS) | set(ADAMW_KEYS))}")
            for flag, keys in ((True, MUON_KEYS), (False, ADAMW_KEYS)):
                members = [(n, p) for n, p in named if default_use_muon(n, p) == flag]
                if members:
                    kept = {k: v for k, v in options.items() if k in keys or k == "initial_lr"}
                    self._append_group(members, flag, kept, where)
        elif isinstance(use_muon, bool):
            self._append_group(named, use_muon, options, where)
        else:
            raise TypeError(f"{where}: use_muon must be a bool, got {use_muon!r}")
        self._mesh_plans = None  # the plan covers every Muon parameter: rebuild it

    def _name_param(self, item: Any, group_index: int, index: int) -> tuple[str, torch.Tensor]:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, param = item
        else:
            name, param = f"param_groups[{group_index}][{index}]", item
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"DMuon: parameter {name!r} is a {type(param).__name__}, expected a torch.Tensor")
        if not param.is_leaf:
            raise ValueError(f"DMuon: parameter {name!r} is not a leaf tensor; pass model parameters")
        return name, param

    def _append_group(
        self, members: list[tuple[str, torch.Tensor]], use_muon: bool, options: dict[str, Any], where: str
    ) -> None:
        if use_muon:
            group = {key: options.get(key, self._muon_defaults[key]) for key in MUON_KEYS}
            check_muon_hyperparameters(group, where)
            for name, param in members:
                check_muon_param(param, name)
        else:
            group = {key: options.get(key, self._adamw_defaults[key]) for key in ADAMW_KEYS}
            check_adamw_hyperparameters(group, where)
        unknown = set(options) - set(group) - {"initial_lr"}
        if unknown:
            known = MUON_KEYS if use_muon else ADAMW_KEYS
            raise ValueError(f"{where}: unknown option(s) {sorted(unknown)} for a {'Muon' if use_muon else 'AdamW'} group; known: {known}")
        if "initial_lr" in options:
            group["initial_lr"] = options["initial_lr"]
        for name, param in members:
            self._names[param] = name
        self.param_groups.append({"params": [p for _, p in members], "use_muon": use_muon, **group})

    def param_name(self, param: torch.Tensor) -> str:
        """The name a parameter was given (or its group position)."""
        return self._names.get(param, "<unnamed parameter>")

    def comm_paths(self) -> dict[str, str]:
        """Name -> path (``local``, ``all_to_all`` or ``redistribute``) of every Muon parameter."""
        self._ensure_plans()
        return {self.param_name(p): path for p, path in self._paths.items()}

    # ------------------------------------------------------------------ planning

    def _ensure_plans(self) -> list[_MeshPlan]:
        """Choose each Muon parameter's path and plan the fast path, once."""
        if self._mesh_plans is not None:
            return self._mesh_plans
        self._paths = {}
        self._distributed_by_mesh = {}
        by_mesh: dict[DeviceMesh, list[torch.Tensor]] = {}
        ns_steps: dict[DeviceMesh, int] = {}  # costs use the largest ns_steps on the mesh
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for param in group["params"]:
                try:
                    path = comm_path(param, self.comm)
                except ValueError as error:
                    raise ValueError(f"DMuon: parameter {self.param_name(param)!r}: {error}") from None
                self._paths[param] = path
                if path != LOCAL:
                    self._distributed_by_mesh.setdefault(param.device_mesh, []).append(param)
                if path == ALL_TO_ALL:
                    by_mesh.setdefault(param.device_mesh, []).append(param)
                    ns_steps[param.device_mesh] = max(ns_steps.get(param.device_mesh, 0), group["ns_steps"])
        plans = []
        for mesh, params in by_mesh.items():
            plan = make_owner_plan([tuple(p.shape) for p in params], mesh.size(), ns_steps[mesh], self.max_batch_numel)
            self._check_rows_agree_with_plan(mesh, params, plan)
            plans.append(_MeshPlan(mesh, params, plan))
        self._mesh_plans = plans
        for path in (ALL_TO_ALL, REDISTRIBUTE, LOCAL):
            names = [self.param_name(p) for p, chosen in self._paths.items() if chosen == path]
            if names:
                logger.info("DMuon: %d Muon parameter(s) use the %s path: %s", len(names), path, ", ".join(names))
        return plans

    def _check_rows_agree_with_plan(self, mesh: DeviceMesh, params: list[torch.Tensor], plan: OwnerPlan) -> None:
        """Every rank's local rows must be the ``torch.chunk`` split the plan assumes.

        DTensors built by FSDP2 or ``distribute_tensor`` always are; one built by
        ``DTensor.from_local`` with custom uneven shards may not be. The check is one
        ``all_reduce`` at planning time, so a mismatch on any rank stops every rank.
        """
        rank = mesh.get_local_rank()
        wrong = [p for p, layout in zip(params, plan.layouts) if p.to_local().shape[0] != layout.rows[rank]]
        count = torch.tensor([len(wrong)], dtype=torch.int32, device=params[0].to_local().device)
        dist.all_reduce(count, group=mesh.get_group())
        if count.item():
            mine = f" here: {[self.param_name(p) for p in wrong]}" if wrong else ""
            raise ValueError(
                f"DMuon: {count.item()} Shard(0) parameter shard(s) on {mesh} do not follow torch.chunk's row "
                f"split{mine}. Shard them with FSDP2 or distribute_tensor, or pass use_muon=False for them."
            )

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_plans()
        work = self._muon_momentum()
        self._orthogonalize_and_update(work)
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group_step(group)
        return loss

    def _muon_momentum(self) -> dict[torch.Tensor, _MuonWork]:
        """Check every grad and agree on the grad set, then run momentum on the local
        shards of every Muon parameter with a grad. Nothing is modified before the checks
        pass, so a rejected step leaves parameters and state as they were."""
        problems: dict[torch.Tensor, str] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    problem = _grad_problem(param, group["use_muon"])
                    if problem:
                        problems[param] = problem
        self._agree_on_grads(problems)
        work: dict[torch.Tensor, _MuonWork] = {}
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if isinstance(param, DTensor) and grad.placements != param.placements:
                    grad = grad.redistribute(param.device_mesh, param.placements)
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                update = muon_momentum_(
                    _local(grad), _local(state["momentum_buffer"]), group["momentum"], group["nesterov"]
                )
                work[param] = _MuonWork(param, group, update)
        return work

    def _agree_on_grads(self, problems: dict[torch.Tensor, str]) -> None:
        """One ``all_reduce`` per mesh: every rank must see the same distributed grads.

        Counts, per parameter, the ranks that have a grad, plus the ranks that found an
        invalid grad. Every rank sees the same sums, so every rank raises the same
        error or none does: no rank is left waiting in a collective.
        """
        local_problem = next(iter(problems.items()), None)
        for mesh, params in self._distributed_by_mesh.items():
            counts = torch.tensor(
                [int(p.grad is not None) for p in params] + [int(local_problem is not None)],
                dtype=torch.int32,
                device=params[0].to_local().device,
            )
            for dim in range(mesh.ndim):  # summing over each mesh dim sums over the whole mesh
                dist.all_reduce(counts, group=mesh.get_group(dim))
            *have, bad = counts.tolist()
            if local_problem:
                break
            if bad:
                raise ValueError(f"DMuon: {bad} rank(s) found an invalid gradient; see their error message")
            uneven = [self.param_name(p) for p, n in zip(params, have) if n not in (0, mesh.size())]
            if uneven:
                raise RuntimeError(
                    f"DMuon: ranks disagree on which parameters have gradients: {uneven} have a grad on "
                    f"some ranks of {mesh} but not on others. Every rank must produce the same set of "
                    "grads (set unused grads to zeros, or to None on every rank)."
                )
        if local_problem:
            param, problem = local_problem
            raise ValueError(f"DMuon: parameter {self.param_name(param)!r}: {problem}")

    def _orthogonalize_and_update(self, work: dict[torch.Tensor, _MuonWork]) -> None:
        for mesh_plan in self._ensure_plans():
            self._owner_computed(mesh_plan, work)
        for param, item in work.items():
            path = self._paths[param]
            if path == REDISTRIBUTE:
                self._apply(item, self._redistributed_orthogonalize(param, item.update, item.group))
            elif path == LOCAL:
                self._apply(item, _orthogonalize_param(item.update, item.group))

    def _owner_computed(self, mesh_plan: _MeshPlan, work: dict[torch.Tensor, _MuonWork]) -> None:
        """The fast path: per batch, gather to owners, orthogonalize owned, scatter back.

        The next batch's gather is started before this batch's Newton-Schulz so the
        two can overlap; every rank issues the same collectives in the same order.
        """
        plan, params = mesh_plan.plan, mesh_plan.params
        group, rank = mesh_plan.mesh.get_group(), mesh_plan.mesh.get_local_rank()
        batches = [[i for i in batch if params[i] in work] for batch in plan.batches]
        batches = [batch for batch in batches if batch]
        if not batches:
            return

        def start_gather(batch: list[int]) -> Exchange:
            send = pack_gather(plan, batch, rank, {i: work[params[i]].update for i in batch})
            return Exchange(send, *plan.gather_splits(batch, rank), group, rank, self.comm_stats)

        scatters: list[tuple[list[int], Exchange]] = []
        pending = start_gather(batches[0])
        for k, batch in enumerate(batches):
            gather = pending
            full = unpack_gather(plan, batch, rank, gather.wait())
            if k + 1 < len(batches):
                pending = start_gather(batches[k + 1])
            results = {i: _orthogonalize_param(m, work[params[i]].group) for i, m in full.items()}
            send = pack_scatter(plan, batch, rank, results)
            # The scatter is the gather reversed: it sends what the gather received.
            scatter = Exchange(send, gather.recv_splits, gather.send_splits, group, rank, self.comm_stats)
            scatters.append((batch, scatter))
        for batch, exchange in scatters:
            local = unpack_scatter(plan, batch, rank, exchange.wait())
            for i in batch:
                self._apply(work[params[i]], local[i])

    def _redistributed_orthogonalize(
        self, param: DTensor, update: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """The reference path: all-gather the bf16 update, orthogonalize it on every
        rank, keep this rank's part (a local slice, no communication)."""
        mesh, placements = param.device_mesh, param.placements
        full = DTensor.from_local(update, mesh, placements, shape=param.shape, stride=param.stride()).full_tensor()
        ortho = _orthogonalize_param(full, group)
        return distribute_tensor(ortho, mesh, placements, src_data_rank=None).to_local()

    def _apply(self, item: _MuonWork, ortho_local: torch.Tensor) -> None:
        group = item.group
        scale = shape_scale(item.param.shape, group["adjust_lr"], group["matched_adamw_rms"])
        apply_muon_update_(_local(item.param), ortho_local, group["lr"], group["weight_decay"], scale)

    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            adamw_step_(
                params, grads, exp_avgs, exp_avg_sqs, steps,
                lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                has_complex=any(p.is_complex() for p in params),
            )


def _grad_problem(param: torch.Tensor, use_muon: bool) -> str | None:
    """Why ``param.grad`` cannot be used, or None."""
    grad = param.grad
    if grad.is_sparse:
        return "sparse gradients are not supported"
    if not use_muon:
        return None
    if grad.is_complex():
        return "complex gradients are not supported by Muon"
    if grad.shape != param.shape:
        return f"gradient shape {tuple(grad.shape)} differs from the parameter's {tuple(param.shape)}"
    if isinstance(param, DTensor) != isinstance(grad, DTensor):
        return "the parameter and its gradient must both be DTensors or both plain tensors"
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own data: the local shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _orthogonalize_param(update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Orthogonalize a whole parameter-shaped bf16 tensor (any ndim >= 2)."""
    shape = update.shape
    ortho = orthogonalize(
        update.reshape(matrix_shape(shape)), group["ns_coefficients"], group["ns_steps"], group["eps"]
    )
    return ortho.reshape(shape)
