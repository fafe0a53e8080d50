"""The owner exchange's order of events per batch, and the scratch memory each event
makes and frees: written once, as data, for the step (``dmuon.exchange.owner_exchange``
executes it), the memory bound and the cost model to read. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dmuon.plan.owner_plan import OwnerPlan

# The events of one step of the owner exchange, per batch (see :func:`batch_schedule`).
START_GATHER = "start_gather"  # momentum, pack the blocks, start the gather all_to_all
FINISH_GATHER = "finish_gather"  # wait for it; owners cut their whole matrices out
NEWTON_SCHULZ = "newton_schulz"  # the batch's kept-local and owned units
START_SCATTER = "start_scatter"  # pack the results, start the scatter all_to_all
FINISH_SCATTER = "finish_scatter"  # wait for it; apply the returned blocks
COLLECTIVE_EVENTS = (START_GATHER, FINISH_GATHER, START_SCATTER, FINISH_SCATTER)


def batch_schedule(n_batches: int) -> tuple[tuple[str, int], ...]:
    """The owner exchange's order of events, ``(event, batch)``, for ``n_batches`` batches.

    Written once, as data: ``dmuon.exchange.owner_exchange`` executes it, and
    :func:`scratch_events` (memory) and ``dmuon.plan.cost_model.overlapped_ms`` (time) read
    it. Batch ``b``'s gather finishes, then gather ``b + 1`` starts, so it travels while
    this rank runs batch ``b``'s Newton-Schulz; scatter ``b`` starts once its results
    exist, and scatter ``b - 1`` finishes only after that, so it too travels during
    Newton-Schulz ``b``. At most three batches' buffers are alive at once.
    """
    if n_batches <= 0:
        return ()
    events = [(START_GATHER, 0)]
    for b in range(n_batches):
        events.append((FINISH_GATHER, b))
        if b + 1 < n_batches:
            events.append((START_GATHER, b + 1))
        events += [(NEWTON_SCHULZ, b), (START_SCATTER, b)]
        if b > 0:
            events.append((FINISH_SCATTER, b - 1))
    events.append((FINISH_SCATTER, n_batches - 1))
    return tuple(events)


def scratch_events(plan: OwnerPlan, rank: int) -> list[int]:
    """The step's scratch allocations (+numel) and frees (-numel) on ``rank``, in order:
    :func:`batch_schedule`, each event as the buffers it makes and frees.

    - start gather(b): send buffer (each chunk's blocks packed straight into it: their
      look-ahead is the elementwise scratch of ``dmuon.dry_run.memory_bound``); receive buffer;
    - finish gather(b): send freed; the owned whole matrices, one buffer, are cut from
      the receive buffer (receive freed);
    - Newton-Schulz(b): units kept local: update copy, result, both freed; owned
      travelling units: their results, then the whole matrices' buffer freed;
    - start scatter(b): the results flattened into one buffer and freed, the send
      buffer filled from it and it freed (even row chunks, blocks of columns: the send
      buffer filled from the results, freed); receive buffer;
    - finish scatter(b): send freed, blocks applied, receive freed.
    """
    sizes = []
    for batch in plan.batches:
        gather_send, gather_recv = plan.gather_splits(batch, rank)
        scatter_send, scatter_recv = plan.scatter_splits(batch, rank)
        owned_units = [plan.units[i] for i in plan.travelling(batch) if plan.units[i].owner == rank]
        owned = [unit.numel for unit in owned_units]
        local = [plan.units[i].numel for i in plan.kept_local(batch, rank)]
        rows_only = all(u.rows_only for u in owned_units) and not all(u.even_rows(plan.world_size) for u in owned_units)
        sizes.append((sum(gather_send), sum(gather_recv), owned, rows_only, local, sum(scatter_send),
                      sum(scatter_recv)))

    events: list[int] = []
    for event, b in batch_schedule(len(sizes)):
        send, recv, owned, rows_only, local, scatter_send, scatter_recv = sizes[b]
        if event == START_GATHER:
            events.extend((send, recv))
        elif event == FINISH_GATHER:
            events.extend((-send, sum(owned), -recv))
        elif event == NEWTON_SCHULZ:
            for numel in local:
                events.extend((numel, numel, -numel, -numel))
            events.extend(owned)  # the results; the whole matrices are one buffer, freed after them
            events.append(-sum(owned))
        elif event == START_SCATTER:
            if rows_only:  # results flattened into one buffer, freed; the send buffer filled from it
                events.extend((sum(owned), -sum(owned), scatter_send, -sum(owned), scatter_recv))
            else:  # the send buffer filled from the results (by chunks, or block by block), freed
                events.extend((scatter_send, -sum(owned), scatter_recv))
        else:
            events.extend((-scatter_send, -scatter_recv))
    return events
