"""QK-clip inside ``DMuon``. No weight travels: each rank learns every head's largest logit
from one ``all_reduce(MAX)`` of a small vector (one float per head of every registered
attention) over the ranks of the weights' mesh, computes the same factors
(``dmuon.attention.qk_clip``), and scales the rows it holds: FSDP's row shards, TP's
column-wise (``Shard(0)``) shards, FSDP+TP's strided rows, replicas, all read from the
placements (``dmuon.plan.layout.local_indices``). The factors are equal on every rank and the
scaling is elementwise, so the clipped weights are bitwise those of a single process.

Every rank runs the reduction at every step, whatever its grads or logits, so ranks stay in
step; a rank that saw no logits contributes ``-inf``."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from dmuon.attention.max_logits import MaxLogitTracker
from dmuon.attention.qk_clip import FUSED_GROUPED, AttentionHeads, clip_factors, row_scales, scale_rows_
from dmuon.exchange.comm import mesh_device
from dmuon.exchange.groups import group_of
from dmuon.exchange.host_copy import HostCopy
from dmuon.exchange.host_staging import QK_CLIP_FACTORS, HostStaging, staging_for
from dmuon.exchange.reductions import max_in_place
from dmuon.plan.layout import Range, local_indices
from dmuon.plan.mesh_facts import mesh_ranks
from dmuon.torch_compat import local_of

logger = logging.getLogger("dmuon")


@dataclass(frozen=True)
class ClipTarget:
    """One attention QK-clip watches: its name in the tracker, its weights, its heads."""

    name: str
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    heads: AttentionHeads


@dataclass(frozen=True)
class ClipResult:
    """What one step's QK-clip saw and did (tensors on the weights' device: no sync)."""

    max_logits: dict[str, torch.Tensor]
    """Each attention's per-head largest logit over every rank, before clipping."""
    largest: torch.Tensor
    """The largest of them (0-d, float32)."""
    clipped_heads: torch.Tensor
    """How many heads were clipped (0-d, int64)."""


class AttentionClip:
    """The attentions of one ``DMuon`` that QK-clip watches, and the clip itself."""

    def __init__(self) -> None:
        self.tracker = MaxLogitTracker()
        self.targets: list[ClipTarget] = []
        self._checked_reports = False
        self._warned_silent = False
        self._reports: HostCopy | None = None  # the last step's "reported on some rank", per attention
        self._staging: HostStaging | bool | None = None  # FSDP2's CPU offload: factors come down in one copy
        self.last: ClipResult | None = None  # the last step's result (None before the first step)

    def add(self, name: str, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: AttentionHeads,
            param_name: Callable[[torch.Tensor], str]) -> None:
        """Register one attention; every rank registers the same ones, in the same order."""
        where = f"DMuon.clip_attention({name!r})"
        if any(t.name == name for t in self.targets):
            raise ValueError(f"{where}: an attention of this name is already registered")
        if not isinstance(heads, AttentionHeads):
            raise TypeError(f"{where}: heads must be a dmuon.AttentionHeads, got {type(heads).__name__}")
        if heads.row_layout == FUSED_GROUPED and q_weight is not k_weight:
            raise ValueError(f"{where}: the fused row layout has one weight (W_qkv): pass it as q_weight and k_weight")
        q_rows, k_rows = heads.weight_rows()
        for role, weight, rows in (("q_weight", q_weight, q_rows), ("k_weight", k_weight, k_rows)):
            if weight.ndim != 2 or weight.shape[0] != rows:
                raise ValueError(
                    f"{where}: {role} {param_name(weight)} has shape {tuple(weight.shape)}; {heads} needs "
                    f"{rows} rows (one block of head_dim rows per head) of a 2-D weight")
            if isinstance(weight, DTensor) and any(isinstance(p, Partial) for p in weight.placements):
                raise ValueError(f"{where}: {role} {param_name(weight)} has a Partial placement; QK-clip "
                                 "scales the rows each rank holds, so it needs sharded or replicated weights")
        # The registered weights already share one rank set: comparing with the first is enough.
        registered = [self.targets[0].q_weight] if self.targets else []
        meshes = {_ranks(w) for w in (q_weight, k_weight, *registered)}
        if len(meshes) > 1:
            raise ValueError(f"{where}: every QK-clip weight must live on the same ranks (one mesh, or all plain "
                             f"tensors), so one reduction of the logits serves them all; got rank sets {meshes}")
        self.targets.append(ClipTarget(name, q_weight, k_weight, heads))

    def thresholds(self, threshold_of: Callable[[torch.Tensor, str], float | None]) -> list[float | None]:
        """Each attention's threshold (``threshold_of(weight, role)``: the option of the
        weight's param group), checked on the host before the step changes anything: a
        configuration error raises here, on every rank alike, before any collective."""
        found = []
        for target in self.targets:
            q_threshold = threshold_of(target.q_weight, "q_weight")
            k_threshold = threshold_of(target.k_weight, "k_weight")
            if q_threshold != k_threshold:
                raise ValueError(f"DMuon: attention {target.name!r}: its q and k weights are in param groups with "
                                 f"different qk_clip_threshold ({q_threshold} and {k_threshold}); give both the same")
            found.append(q_threshold)
        return found

    def step(self, thresholds: list[float | None], step_ok: torch.Tensor | None = None) -> ClipResult | None:
        """Reduce this step's logits and clip the heads over their threshold (from
        :meth:`thresholds`); where the 0-dim device bool ``step_ok`` is False, the step's mask,
        every factor is exactly 1 (the weights keep their bits)."""
        if not self.targets:
            return None
        weight = self.targets[0].q_weight  # plain weights: replicated over every rank (DDP)
        device = mesh_device(weight.device_mesh) if isinstance(weight, DTensor) else weight.device
        flat = torch.cat([self.tracker.take(t.name, t.heads.n_heads, device) for t in self.targets])
        max_in_place(flat, group_of(_ranks(weight), [weight.device_mesh]) if isinstance(weight, DTensor)
                     else dist.group.WORLD)
        max_logits = dict(zip((t.name for t in self.targets), flat.split([t.heads.n_heads for t in self.targets])))
        if not self._checked_reports:  # a head no rank saw keeps -inf: read at the next step
            self._reports = HostCopy(torch.stack([(m > -math.inf).any() for m in max_logits.values()]))
        clipped = torch.zeros((), dtype=torch.int64, device=device)
        scalings: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weight, its rows' factors)
        for target, threshold in zip(self.targets, thresholds):
            if threshold is None:
                continue
            gamma = clip_factors(max_logits[target.name], threshold)
            if step_ok is not None:  # a masked step: factors of exactly 1 leave every row's bits
                gamma = torch.where(step_ok, gamma, torch.ones((), dtype=gamma.dtype, device=gamma.device))
            clipped += (gamma != 1).sum()
            q_factors, k_factors = row_scales(target.heads, gamma)
            if target.q_weight is target.k_weight:  # fused: the q and k rows of one weight
                scalings.append((target.q_weight, q_factors * k_factors))
            else:
                scalings.append((target.q_weight, q_factors))
                if not target.heads.shares_keys:  # GQA / MQA: shared keys stay (dmuon.attention.qk_clip)
                    scalings.append((target.k_weight, k_factors))
        for weight, factors in self._where_weights_are(scalings, device):
            local = local_of(weight)
            scale_rows_(local.data if isinstance(local, torch.nn.Parameter) else local, local_rows(weight), factors)
        largest = flat.max() if flat.numel() else torch.full((), -math.inf, device=device)
        self.last = ClipResult(max_logits, largest, clipped)
        return self.last

    def last_max_logits(self) -> dict[str, torch.Tensor]:
        """Each attention's per-head largest logit in the last step, over every rank, before
        clipping (empty before the first step, or without attentions)."""
        return {} if self.last is None else dict(self.last.max_logits)

    def take_pending(self) -> Exception | None:
        """The error the last step's reports show (None if none): read at the start of a step,
        so a step that raises it changes nothing (``DMuon.step`` masks it).

        Until the first step in which some attention reported logits: then every registered
        attention must have reported on some rank, or the model does not call the tracker for it
        and its clip would silently do nothing. A step in which none reported (TorchTitan 0.3's
        state-making step, run before any forward) is let through with one warning. Whether an
        attention reported on some rank is read from the previous step's reduced logits (a head
        no rank saw stays ``-inf``), copied to the host without waiting: every rank reads the
        same values and decides alike, with no host collective, one step after the fact."""
        if self._checked_reports or self._reports is None or self._reports.deferred():
            return None
        reported = self._reports.read()
        self._reports = None
        if reported is None:  # a fake run: no values to check
            return None
        if not any(reported):
            if not self._warned_silent:
                logger.warning("DMuon: QK-clip got no attention logits in the previous step (nothing to clip); "
                               "expected only before the first forward")
                self._warned_silent = True
            return None
        self._checked_reports = True
        silent = [t.name for t, ok in zip(self.targets, reported) if not ok]
        if not silent:
            return None
        return ValueError(
            f"DMuon: QK-clip got no attention logits for {silent} in the previous step while others reported "
            "theirs: call optimizer.max_logits.observe(name, q, k, n_heads=...) in each registered attention's "
            "forward (torchtitan_ext does it for TorchTitan's models)")

    def _where_weights_are(self, scalings: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
                           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The factors where the weights' local rows are: under FSDP2's CPU offload, every
        factor down to the host in one copy and one wait (``dmuon.exchange.host_staging``)."""
        if not scalings:
            return scalings
        if self._staging is None:  # decided at the first clip: whether the weights' rows are off the device
            self._staging = staging_for(local_of(scalings[0][0]).device, device) or False
        if not self._staging:
            return scalings
        weights, factors = zip(*scalings)
        host = self._staging.down(QK_CLIP_FACTORS, torch.cat(factors), QK_CLIP_FACTORS)
        return list(zip(weights, host.split([f.numel() for f in factors])))


def _ranks(weight: torch.Tensor) -> tuple[int, ...] | None:
    """The ranks of a DTensor's mesh; None for a plain tensor."""
    return mesh_ranks(weight.device_mesh) if isinstance(weight, DTensor) else None


def local_rows(weight: torch.Tensor) -> list[Range]:
    """The global rows of ``weight`` this rank holds, in local order."""
    if not isinstance(weight, DTensor):
        return [(0, weight.shape[0])]
    mesh = weight.device_mesh
    return local_indices(weight.shape, tuple(mesh.shape), weight.placements, mesh.get_coordinate())[0]


def muon_group_threshold(groups: Mapping[torch.Tensor, dict[str, Any]], name_of: Callable[[torch.Tensor], str]
                         ) -> Callable[[torch.Tensor, str], float | None]:
    """``threshold_of`` for :meth:`AttentionClip.step`: a weight's Muon group's
    ``qk_clip_threshold``; a weight outside the Muon groups is refused (QK-clip is the clip of
    MuonClip: it follows a Muon step)."""

    def threshold_of(weight: torch.Tensor, role: str) -> float | None:
        if weight not in groups:
            raise ValueError(f"DMuon: QK-clip's {role} {name_of(weight)} is not a Muon parameter of this optimizer; "
                             "route it to Muon (use_muon=True) or do not register its attention")
        return groups[weight]["qk_clip_threshold"]

    return threshold_of
