"""The owner exchange: one step of the owner-computed fast path, for any layout the plan describes.

It runs ``dmuon.plan.batch_schedule`` (``dmuon.plan.scratch_events`` predicts its memory,
``dmuon.plan.cost_model`` its time); every rank issues the same collectives in the same
order. Per batch: its gather completes and each owner cuts its whole matrices from the
receive buffer; the next gather starts (the Nesterov look-ahead of its blocks packed
straight into the send buffer; the momentum EMA ran for every block before the first
batch), so it travels during this batch's Newton-Schulz, on the units this rank keeps whole
(applied at once) and the travelling units it owns; its scatter starts and the previous one
completes. Each buffer is freed as soon as it has been used: scratch is bounded per batch.

The optimizer supplies the math as :class:`Callbacks`, so this module knows nothing of
param groups or state, each called with lists, so a batch costs a few list ops whatever
its number of blocks (``dmuon.exchange.packing``, ``dmuon.numerics.update_rules``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmuon.exchange.comm import WIRE_DTYPE, CommStats, Exchange, ScratchMeter
from dmuon.exchange.host_staging import KEPT, RESULTS, HostStaging
from dmuon.exchange.packing import gather_whole, pack_gather, pack_scatter, scatter_blocks
from dmuon.plan.owner_plan import OwnerPlan
from dmuon.plan.pack_layout import BatchLayout
from dmuon.plan.schedule import FINISH_GATHER, NEWTON_SCHULZ, START_GATHER, START_SCATTER, batch_schedule
from dmuon.plan.units import Unit


@dataclass
class Callbacks:
    """The math and the layouts :func:`run_owner_plan` runs with."""

    pack_blocks: Callable[[Sequence[int]], list[torch.Tensor]]
    """``(units)``: the look-ahead (momentum already ran) of this rank's block of each unit,
    in the parameters' dtype, in order (they are flattened into the send buffer)."""
    update_of: Callable[[int], torch.Tensor]
    """``(unit)``: the bf16 update of a unit this rank holds whole, as its matrix."""
    orthogonalize: Callable[[Unit, torch.Tensor], torch.Tensor]
    """``(unit, matrix)``: Newton-Schulz with the settings of ``unit.param``'s group
    (``unit.dim0``: the rows of it the matrix is)."""
    apply_blocks: Callable[[Sequence[int], Sequence[torch.Tensor]], None]
    """``(units, orthos)``: the decayed, scaled update of this rank's block of each unit with
    its result (a flat view, or the matrix)."""
    layout_of: Callable[[tuple[int, ...]], BatchLayout]
    """``(batch)``: its :class:`~dmuon.plan.pack_layout.BatchLayout` on this rank, made
    once per plan."""
    widen: Callable[[torch.Tensor], torch.Tensor] = lambda recv: recv
    """The scatter's receive buffer in the dtype the update adds it in (itself, or one cast
    of the whole buffer where a list op needs one dtype)."""
    mask_results: Callable[[Sequence[int], Sequence[torch.Tensor]], None] = lambda units, results: None
    """``(units, results)``: zero, in place, the results no rank may apply
    (``dmuon.exchange.grad_status``), on their owner before they travel: one list op."""
    newton_schulz_done: Callable[[], None] = lambda: None
    """A batch's Newton-Schulz is done (its buffers may go:
    ``dmuon.numerics.standard_iteration``)."""


def run_owner_plan(plan: OwnerPlan, *, group: dist.ProcessGroup, rank: int, device: torch.device,
                   callbacks: Callbacks, stats: CommStats, meter: ScratchMeter,
                   staging: HostStaging | None = None) -> None:
    """Orthogonalize and apply every unit of ``plan``, every step, whatever the grads: the
    collectives are the plan's on every rank (what a rank may apply is the callbacks' mask).
    With ``staging`` (FSDP2's CPU offload), blocks are packed and results applied on the
    host, and cross through its buffers (``dmuon.exchange.host_staging``)."""
    batches = plan.batches
    if not batches:
        return
    step = _OwnerStep(plan, group, rank, device, callbacks, stats, meter, staging)
    # What is in flight, by batch: each entry lives from one event of the schedule to the next.
    gathers: dict[int, Exchange] = {}
    owned: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
    results: dict[int, dict[int, torch.Tensor]] = {}
    scatters: dict[int, Exchange] = {}
    for event, b in batch_schedule(len(batches)):
        batch = batches[b]
        if event == START_GATHER:
            gathers[b] = step.start_gather(batch)
        elif event == FINISH_GATHER:
            owned[b] = step.finish_gather(batch, gathers.pop(b))
        elif event == NEWTON_SCHULZ:
            step.orthogonalize_kept(batch)
            results[b] = step.orthogonalize_owned(*owned.pop(b))
            callbacks.newton_schulz_done()
        elif event == START_SCATTER:
            scatters[b] = step.start_scatter(batch, results.pop(b))
        else:
            step.finish_scatter(batch, scatters.pop(b))


@dataclass
class _OwnerStep:
    """The named steps of :func:`run_owner_plan` for one rank. Each frees its scratch
    (``meter.free`` and ``del``) as soon as the schedule lets go of it."""

    plan: OwnerPlan
    group: dist.ProcessGroup
    rank: int
    device: torch.device
    math: Callbacks
    stats: CommStats
    meter: ScratchMeter
    staging: HostStaging | None = None

    def start_gather(self, batch: tuple[int, ...]) -> Exchange:
        layout = self.math.layout_of(batch)
        if self.staging is None:
            send = pack_gather(self.plan, batch, self.rank, self.math.pack_blocks, self.device, self.meter, layout)
        else:  # packed on the host, into the batch's buffer, then up
            host = self.staging.buffer(("gather", batch), layout.send_numel, WIRE_DTYPE)
            pack_gather(self.plan, batch, self.rank, self.math.pack_blocks, host.device, None, layout, host)
            send = self.staging.up(host, self.meter)
        return Exchange(send, *self.plan.gather_splits(batch, self.rank), self.group, self.rank, self.stats,
                        self.device, self.meter)

    def finish_gather(self, batch: tuple[int, ...], gather: Exchange) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The buffer of the whole matrices this rank owns in ``batch``, and each, cut
        from the receive buffer."""
        recv = gather.wait()
        whole = gather_whole(self.plan, self.math.layout_of(batch), recv, self.meter)
        self.meter.free(recv)
        return whole

    def orthogonalize_kept(self, batch: tuple[int, ...]) -> None:
        """The units this rank holds whole and keeps: orthogonalized and applied at once."""
        for i in self.plan.kept_local(batch, self.rank):
            update = self.math.update_of(i)
            update = self.meter.track(update if self.staging is None else self.staging.put(("kept up", i), update))
            ortho = self.meter.track(self.math.orthogonalize(self.plan.units[i], update))
            self.math.mask_results([i], [ortho])
            self.meter.free(update)
            del update
            self.math.apply_blocks([i], [ortho if self.staging is None else
                                         self.staging.down(("kept", i), ortho, KEPT)])
            self.meter.free(ortho)
            del ortho

    def orthogonalize_owned(self, whole: torch.Tensor, matrices: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Newton-Schulz of the gathered matrices, those of one shape back to back (they
        share Newton-Schulz's buffers), the largest first (its workspace is then beside the
        fewest results); their buffer is freed after the last."""
        order = sorted(matrices, key=lambda i: (-self.plan.units[i].numel, self.plan.units[i].matrix))
        results = {i: self.meter.track(self.math.orthogonalize(self.plan.units[i], matrices.pop(i))) for i in order}
        self.math.mask_results(list(results), list(results.values()))
        self.meter.free(whole)
        return results

    def start_scatter(self, batch: tuple[int, ...], results: dict[int, torch.Tensor]) -> Exchange:
        send = pack_scatter(self.plan, batch, self.rank, results, self.device, self.meter, self.math.layout_of(batch))
        return Exchange(send, *self.plan.scatter_splits(batch, self.rank), self.group, self.rank, self.stats,
                        self.device, self.meter)

    def finish_scatter(self, batch: tuple[int, ...], scatter: Exchange) -> None:
        recv = scatter.wait()
        layout = self.math.layout_of(batch)
        received = recv if self.staging is None or not layout.scatter_recv_units else \
            self.staging.down(("results", batch), recv, RESULTS)
        self.math.apply_blocks(layout.scatter_recv_units, scatter_blocks(layout, self.math.widen(received)))
        self.meter.free(recv)
