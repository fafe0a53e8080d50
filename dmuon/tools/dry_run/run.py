"""One rank's dry run: build, lay out, four real DMuon steps, and what the second did.

The first step makes the state and the plan (and runs the plan's one-time checks); the
second is the steady step every later one repeats, and the third and fourth show that it
does (the same program); each runs under :class:`~dmuon.tools.dry_run.recorder.StepRecorder`.
The steps run under a schedule that changes every group's learning rate and weight decay
at every step (:func:`schedule`), as a real job's does, so the report also says whether
the steady steps launch their kernels with the same host values (what a CUDA graph
replays). The optimizer is the unmodified ``dmuon.DMuon``; only the model's size, the
process group and the tensors are fake.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate

from dmuon.attention.qk_clip import AttentionHeads
from dmuon.tools.dry_run.fake_cuda import fake_cuda_rank
from dmuon.tools.dry_run.host_costs import counting_groups, plan_host_bytes
from dmuon.tools.dry_run.layouts import LayoutSpec, lay_out, make_mesh
from dmuon.tools.dry_run.memory_bound import peak_bound_bytes
from dmuon.tools.dry_run.models import Preset, Transformer, build
from dmuon.tools.dry_run.offload import documented_waits
from dmuon.tools.dry_run.recorder import HostTensorsStayReal, StepRecord, StepRecorder, first_scalar_changes
from dmuon.step.group_steps import NORMUON_STATE_KEY
from dmuon.optimizer import DMuon
from dmuon.plan.owner_plan import WIRE_BYTES
from dmuon.torch_compat import local_of

# Tokens per rank of the logits the attentions report to QK-clip (their cost is the
# forward's, not the step's; any length shows the step's work).
QK_CLIP_SEQ = 16
# The run's learning rate and weight decay, from which :func:`schedule` ramps both.
LR, WEIGHT_DECAY = 0.02, 0.1
# The parameter dtypes a dry run can lay out (``--param-dtype``).
PARAM_DTYPES = ("float32", "bfloat16", "float16")
# The most Python heap a rank's plan may keep (docs/dry_run.md: what it holds and the
# figures per layout): a base, plus so much per unit and per rank, never per unit x rank.
# (llama3 70B, 560 units: 0.9 MiB at P = 64, 1.2 MiB at P = 1024.)
PLAN_HEAP_BASE_BYTES = 1 << 20
PLAN_HEAP_BYTES_PER_UNIT = 4 << 10
PLAN_HEAP_BYTES_PER_RANK = 256


def plan_heap_bound(units: int, world_size: int) -> int:
    """The bound ``plan_host_bytes`` is checked against, for a plan of ``units`` on ``world_size`` ranks."""
    return PLAN_HEAP_BASE_BYTES + PLAN_HEAP_BYTES_PER_UNIT * units + PLAN_HEAP_BYTES_PER_RANK * world_size


@dataclass(frozen=True)
class DryRunConfig:
    """A model, its layout and world size, and the DMuon options of the run."""

    model: str
    preset: Preset
    layout: LayoutSpec
    world_size: int
    options: dict = field(default_factory=dict)
    """Keyword arguments of ``DMuon`` (``normuon``, ``qk_clip_threshold``, ...)."""
    nccl_alone: bool = False
    """The default group takes no CPU tensors, as NCCL alone (``dmuon.tools.dry_run.host_costs``)."""
    param_dtype: str = "float32"
    """The parameters' dtype (and so their grads' and state's): ``float32`` as TorchTitan
    keeps sharded parameters, or ``bfloat16``/``float16`` as a user of the FSDP2 API may."""
    cpu_offload: bool = False
    """FSDP2's ``CPUOffloadPolicy``: parameters, grads and state on the host (``dmuon.tools.dry_run.offload``)."""


@dataclass
class RankReport:
    """What one rank's steady step did (every figure from the recorder, except the
    ``plan_``/``bound`` ones, which are the predictions it is checked against)."""

    rank: int
    host_syncs_per_step: int
    host_sync_sites: list[str]
    bytes_sent_per_rank: int
    plan_bytes_sent_per_rank: int
    collectives: list[dict]
    device_ops_per_step: int
    state_bytes: int
    peak_step_bytes: int
    peak_bound_bytes: int
    mixed_device_ops: list[str]
    precision_hazards: list[str]
    """Ops that read a 0-dim device scalar of another dtype than their bf16/fp16 tensors."""
    state_layout_problems: list[str]
    muon_params: int
    adamw_params: int
    seconds: float
    host_collectives_per_step: int = 0
    """Collectives on CPU tensors in the steady step (each meets every host of its group)."""
    process_groups_made: int = 0
    """Process groups made from DMuon's construction to the end of the fourth step."""
    per_tensor_list_ops: dict[str, int] = field(default_factory=dict)
    """``torch._foreach_*`` calls of the steady step off torch's multi-tensor route (one kernel
    per tensor), by op: reported, not a problem (docs/dry_run.md says which and why)."""
    plan_host_bytes: int = 0
    """Python heap the plan keeps (``tracemalloc``): paths, owner plan, blocks, layouts."""
    plan_heap_bound_bytes: int = PLAN_HEAP_BASE_BYTES
    """What it may keep: :func:`plan_heap_bound` of the plan's units and ranks."""
    same_program: bool = True
    """Steps 2 to 4 dispatched the same device ops and collectives, in order, with the
    same shapes."""
    same_scalars: bool = True
    """Steps 2 to 4 also launched them with the same host values (non-tensor arguments,
    0-dim CPU tensors) under a learning rate and weight decay that change every step: a
    CUDA graph captured once replays them right. Required with ``capturable``; without it
    the step bakes the learning rate into its launches, and the report says so."""
    capturable: bool = False
    """The run's ``DMuon(capturable=...)``: whether :attr:`same_scalars` is required."""
    scalar_changes: list[str] = field(default_factory=list)
    """The first ops whose host values changed with the schedule (``op: step 2 -> 3 -> 4``)."""
    muon_state_bytes: int = 0
    """The Muon parameters' state on this rank (momentum, its int8 scales, NorMuon's rows)."""
    muon_elements: int = 0
    """The Muon parameters' local elements on this rank."""
    adamw_state_bytes: int = 0
    """The AdamW part's state on this rank (both moments, int8's scales, the step counters)."""
    adamw_elements: int = 0
    """The AdamW parameters' local elements on this rank."""
    model_state_bytes: int = 0
    """The whole optimizer state of the model (Muon's and AdamW's), each state tensor at its
    global size (a DTensor's global shape: one copy of the state per copy of the model, the sum of
    the ranks' local shards under FSDP), from the live state tensors (:func:`model_state_bytes`)."""
    model_adamw_state_bytes: int = 0
    """The AdamW part's share of :attr:`model_state_bytes`."""
    model_params: int = 0
    """The model's parameters (every parameter's global elements)."""
    model_adamw_params: int = 0
    """The AdamW parameters' global elements."""
    offload_waits: dict = field(default_factory=dict)
    """Under ``cpu_offload``: the steady step's waits by kind, and the documented ones."""
    documented_offload_waits: dict = field(default_factory=dict)
    host_syncs_first_step: int = 0
    """Host syncs of the first step (state and plan made, the plan checked): 0 too.
    (Every other figure is the steady step's; mixed-device ops are both steps'.)"""
    error: str | None = None
    """What the steady step raised (an op that mixed devices, a host read of a value
    the dry run cannot make up), or None."""

    @property
    def muon_state_bytes_per_element(self) -> float:
        """The Muon state's bytes per local Muon element (4 for fp32 momentum, 2 bf16, 1.03 int8)."""
        return self.muon_state_bytes / self.muon_elements if self.muon_elements else 0.0

    @property
    def state_bytes_per_param(self) -> float:
        """The whole optimizer state (Muon + AdamW) in bytes per parameter of the model (global)."""
        return self.model_state_bytes / self.model_params if self.model_params else 0.0

    @property
    def adamw_state_bytes_per_param(self) -> float:
        """The AdamW part's state in bytes per parameter of the model (global): its share of
        :attr:`state_bytes_per_param`."""
        return self.model_adamw_state_bytes / self.model_params if self.model_params else 0.0

    @property
    def adamw_state_bytes_per_element(self) -> float:
        """The AdamW part's state in bytes per AdamW parameter element (global): 8 for fp32 moments."""
        return self.model_adamw_state_bytes / self.model_adamw_params if self.model_adamw_params else 0.0

    @property
    def graph_pool_bytes(self) -> int:
        """With ``capturable``: what a CUDA graph of the step keeps reserved in its private
        memory pool for as long as it lives, beside activations: at least the step's peak
        above parameters, grads and state (every allocation made while capturing is served
        from the graph's pool, which keeps the most it held; the caching allocator rounds
        blocks up). 0 without ``capturable``."""
        return self.peak_step_bytes if self.capturable else 0

    def problems(self) -> list[str]:
        """Why this rank fails the dry run's checks (empty: it passes)."""
        found = [self.error] if self.error else []
        if self.host_syncs_first_step:
            found.append(f"{self.host_syncs_first_step} host sync(s) in the first step")
        if self.host_syncs_per_step:
            found.append(f"{self.host_syncs_per_step} host sync(s): {'; '.join(self.host_sync_sites[:5])}")
        if self.offload_waits != self.documented_offload_waits:
            found.append(f"offload waits {self.offload_waits}, documented {self.documented_offload_waits}")
        if self.mixed_device_ops:
            found.append(f"ops mixing CPU and CUDA tensors: {'; '.join(self.mixed_device_ops[:5])}")
        if self.host_collectives_per_step:
            found.append(f"{self.host_collectives_per_step} collective(s) on CPU tensors per step")
        if self.process_groups_made:
            found.append(f"{self.process_groups_made} process group(s) made by DMuon")
        if self.plan_host_bytes > self.plan_heap_bound_bytes:
            found.append(f"the plan keeps {self.plan_host_bytes} bytes of Python heap, over its bound "
                         f"{self.plan_heap_bound_bytes} (dmuon.tools.dry_run.run.plan_heap_bound)")
        if not self.same_program:
            found.append("steps 2 to 4 dispatched different device programs")
        elif self.capturable and not self.same_scalars:
            found.append(f"capturable, but steps 2 to 4 launched different host values: {self.scalar_changes[:3]}")
        if self.precision_hazards:
            found.append(f"{len(self.precision_hazards)} op(s) lose a scalar's precision on CUDA: "
                         f"{'; '.join(self.precision_hazards[:5])}")
        if self.bytes_sent_per_rank != self.plan_bytes_sent_per_rank:
            found.append(f"sent {self.bytes_sent_per_rank} bytes, the plan says {self.plan_bytes_sent_per_rank}")
        if self.peak_step_bytes > self.peak_bound_bytes:
            found.append(f"peak step memory {self.peak_step_bytes} bytes is over the bound {self.peak_bound_bytes}")
        if self.state_layout_problems:
            found.append(f"state not laid out as documented: {'; '.join(self.state_layout_problems[:5])}")
        cpu_collectives = [c for c in self.collectives if c["device"] == "cpu" and not _host_agreement(c)]
        if cpu_collectives:
            found.append(f"collectives on CPU tensors (NCCL would refuse them): {cpu_collectives}")
        return found

    def as_dict(self) -> dict:
        return {**asdict(self), "muon_state_bytes_per_element": round(self.muon_state_bytes_per_element, 4),
                "state_bytes_per_param": round(self.state_bytes_per_param, 4),
                "adamw_state_bytes_per_param": round(self.adamw_state_bytes_per_param, 4),
                "adamw_state_bytes_per_element": round(self.adamw_state_bytes_per_element, 4),
                "graph_pool_bytes": self.graph_pool_bytes}


def _host_agreement(row: dict) -> bool:
    """DMuon's host agreements: sums of a few int64 on the CPU (``dmuon.exchange.groups``)."""
    return row["op"].startswith("c10d.allreduce_") and row["dtype"] == "int64"


def schedule(optimizer: DMuon, step: int) -> None:
    """Every group's learning rate and weight decay at ``step`` (0-based): a warm-up-like
    ramp of both from the run's ``LR`` and ``WEIGHT_DECAY``, different at every step, set in
    ``param_groups`` as torch's schedulers do (in place where a group holds tensors:
    ``capturable``)."""
    for group in optimizer.param_groups:
        for key, value in (("lr", LR * (step + 1) / 4), ("weight_decay", WEIGHT_DECAY * (1 + step / 8))):
            if isinstance(group[key], torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = value


def run_rank(config: DryRunConfig, rank: int) -> RankReport:
    """Be ``rank`` of ``config.world_size``; build, lay out, step four times, report."""
    start = time.perf_counter()
    with fake_cuda_rank(rank, config.world_size, config.nccl_alone):
        with HostTensorsStayReal():
            mesh = make_mesh(config.layout)
            with torch.device("cuda"):
                model = build(config.preset, getattr(torch, config.param_dtype))
            lay_out(model, config.layout, mesh, config.cpu_offload)
        with counting_groups() as groups:
            optimizer = DMuon(model.named_parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **config.options)
            if config.options.get("qk_clip_threshold") is not None:
                _register_attentions(optimizer, model, config.preset)
            for param in model.parameters():
                param.grad = torch.empty_like(param)
            first, steady, again, fourth, error = StepRecorder(), StepRecorder(), StepRecorder(), StepRecorder(), None
            try:
                with first:
                    plan_bytes = plan_host_bytes(optimizer)  # what the first step would plan
            except Exception as exc:  # noqa: BLE001 - reported with what was recorded up to it
                plan_bytes, error = 0, f"planning raised {type(exc).__name__}: {str(exc)[:500]}"
            for step, (label, recorder) in enumerate((("first", first), ("steady", steady), ("third", again),
                                                      ("fourth", fourth))):
                if error:
                    break
                schedule(optimizer, step)
                _report_logits(optimizer, model, config)
                try:
                    with recorder:  # a host read gets a placeholder instead of raising
                        optimizer.step()
                except Exception as exc:  # noqa: BLE001 - reported with what was recorded up to it
                    error = f"the {label} step raised {type(exc).__name__}: {str(exc)[:500]}"
        report = _report(rank, optimizer, steady.record, time.perf_counter() - start)
        report.error = error
        report.host_syncs_first_step = len(first.record.host_syncs)
        report.mixed_device_ops = first.record.mixed_device_ops + report.mixed_device_ops
        report.precision_hazards = first.record.precision_hazards + report.precision_hazards
        report.process_groups_made = groups.made
        report.plan_host_bytes = plan_bytes
        plans = optimizer.owner_plans()
        report.plan_heap_bound_bytes = plan_heap_bound(sum(len(p.units) for p in plans), config.world_size)
        steps = [steady.record, again.record, fourth.record]
        report.same_program = all(r.program == steady.record.program for r in steps)
        report.scalar_changes = first_scalar_changes([r.program for r in steps], [r.scalars for r in steps])
        report.same_scalars = report.same_program and not report.scalar_changes
        report.capturable = bool(config.options.get("capturable"))
        report.offload_waits = dict(Counter(steady.record.offload_waits))
        report.documented_offload_waits = documented_waits(optimizer, config.options) if config.cpu_offload else {}
        return report


def _report(rank: int, optimizer: DMuon, record: StepRecord, seconds: float) -> RankReport:
    plans = optimizer.owner_plans()
    muon_state = optimizer.state_bytes()
    groups = optimizer.param_groups
    return RankReport(
        rank=rank,
        host_syncs_per_step=len(record.host_syncs),
        host_sync_sites=record.host_syncs,
        host_collectives_per_step=sum(row.count for row in record.collectives.values() if row.device == "cpu"),
        bytes_sent_per_rank=record.bytes_sent,
        plan_bytes_sent_per_rank=sum(plan.bytes_sent(_plan_rank(optimizer), WIRE_BYTES) for plan in plans),
        collectives=[asdict(row) for row in record.collectives.values()],
        device_ops_per_step=sum(record.device_ops.values()),
        per_tensor_list_ops=dict(record.per_tensor_list_ops),
        state_bytes=sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor) and t.device.type != "cpu"),
        muon_state_bytes=muon_state.muon_bytes,
        muon_elements=muon_state.muon_elements,
        adamw_state_bytes=muon_state.adamw_bytes,
        adamw_elements=muon_state.adamw_elements,
        **model_state_bytes(optimizer),
        peak_step_bytes=record.peak_bytes,
        peak_bound_bytes=peak_bound_bytes(optimizer, _plan_rank(optimizer)),
        mixed_device_ops=record.mixed_device_ops,
        precision_hazards=record.precision_hazards,
        state_layout_problems=state_layout_problems(optimizer),
        muon_params=sum(len(g["params"]) for g in groups if g["use_muon"]),
        adamw_params=sum(len(g["params"]) for g in groups if not g["use_muon"]),
        seconds=round(seconds, 2),
    )


def model_state_bytes(optimizer: DMuon) -> dict[str, int]:
    """The model's whole optimizer state and parameters, global (:class:`RankReport`'s ``model_*``
    fields): every state tensor (momentum, int8 values and scales, NorMuon's rows, AdamW's moments
    and step counters) at its global size, a DTensor's by its global shape (the sum of its shards
    under FSDP, one replica under HSDP or a replicated placement), a plain tensor's as it is; and
    every parameter's global elements. From the live tensors' shapes and dtypes: no collective."""
    totals = {"model_state_bytes": 0, "model_adamw_state_bytes": 0, "model_params": 0, "model_adamw_params": 0}
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = sum(math.prod(t.shape) * t.dtype.itemsize for t in optimizer.state.get(param, {}).values()
                        if isinstance(t, torch.Tensor))
            totals["model_state_bytes"] += state
            totals["model_params"] += math.prod(param.shape)
            if not group["use_muon"]:
                totals["model_adamw_state_bytes"] += state
                totals["model_adamw_params"] += math.prod(param.shape)
    return totals


def state_layout_problems(optimizer: DMuon) -> list[str]:
    """Where the state is not as docs/optimizer.md says: every tensor on the
    parameter's device, laid out like the parameter (same mesh and placements), except
    NorMuon's per-row moment (replicated on the parameter's mesh) and AdamW's ``step``
    (a CPU scalar, as torch.optim.AdamW keeps it; on the parameter's device with
    ``capturable``, as torch.optim.AdamW(capturable=True) keeps it)."""
    problems = []
    capturable = {id(p): bool(g.get("capturable")) for g in optimizer.param_groups for p in g["params"]}
    for param, state in optimizer.state.items():
        name = optimizer.param_name(param)
        for key, value in state.items():
            if key == "step":
                where = local_of(param).device.type if capturable[id(param)] else "cpu"
                if value.device.type != where or value.ndim:
                    problems.append(f"{name} {key}: a scalar on {where} expected, got {value.device} shape "
                                    f"{tuple(value.shape)}")
                continue
            if value.device.type != param.device.type:
                problems.append(f"{name} {key}: on {value.device}, the parameter on {param.device}")
            if isinstance(param, DTensor):
                expected = (tuple(Replicate() for _ in param.placements) if key == NORMUON_STATE_KEY
                            else tuple(param.placements))
                if not isinstance(value, DTensor) or value.device_mesh != param.device_mesh \
                        or tuple(value.placements) != expected:
                    problems.append(f"{name} {key}: not a DTensor on the parameter's mesh with placements {expected}")
    return problems


def _plan_rank(optimizer: DMuon) -> int:
    """This rank's place in the fast path's plan (its rank in the plan's group)."""
    run = optimizer.phases.fast_path.owner_run  # the dry run reads the plan it checks
    return run.rank if run is not None else 0


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _register_attentions(optimizer: DMuon, model: Transformer, preset: Preset) -> None:
    heads = AttentionHeads(n_heads=preset.n_heads, n_kv_heads=preset.n_kv_heads, head_dim=preset.head_dim)
    for i, block in enumerate(model.layers):
        optimizer.clip_attention(f"layers.{i}", block.attention.wq.weight, block.attention.wk.weight, heads)


def _report_logits(optimizer: DMuon, model: Transformer, config: DryRunConfig) -> None:
    """What each attention's forward would report to QK-clip: q and k of this rank's
    heads (all of them; under TP, its share at its offset)."""
    if config.options.get("qk_clip_threshold") is None:
        return
    p, tp = config.preset, _tp_degree(config.layout)
    tp_rank = _tp_rank(model)
    heads, kv = p.n_heads // tp, max(p.n_kv_heads // tp, 1)
    with torch.enable_grad():
        for i in range(len(model.layers)):
            q = torch.empty(1, heads, QK_CLIP_SEQ, p.head_dim, device="cuda", dtype=torch.bfloat16)
            k = torch.empty(1, kv, QK_CLIP_SEQ, p.head_dim, device="cuda", dtype=torch.bfloat16)
            optimizer.max_logits.observe(f"layers.{i}", q, k, n_heads=p.n_heads, head_offset=tp_rank * heads)


def _tp_degree(spec: LayoutSpec) -> int:
    return spec.mesh_shape[-1] if "tp" in spec.dim_names else 1


def _tp_rank(model: Transformer) -> int:
    weight = model.layers[0].attention.wq.weight
    if not isinstance(weight, DTensor) or "tp" not in (weight.device_mesh.mesh_dim_names or ()):
        return 0
    return weight.device_mesh.get_local_rank("tp")


def sample_ranks(world_size: int) -> list[int]:
    """The default ranks to impersonate: the first, second, middle and last."""
    return sorted({0, min(1, world_size - 1), world_size // 2, world_size - 1})


def peak_fraction(report: RankReport) -> float:
    return report.peak_step_bytes / report.peak_bound_bytes if report.peak_bound_bytes else math.inf
