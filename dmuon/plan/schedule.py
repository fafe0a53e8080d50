"""The owner exchange's order of events per batch, written once, as data:
``dmuon.exchange.owner_exchange`` executes it, ``dmuon.plan.owner_plan.scratch_events``
(memory) and ``dmuon.plan.cost_model.overlapped_ms`` (time) read it. Pure."""

from __future__ import annotations

START_GATHER = "start_gather"  # momentum, pack the blocks, start the gather all_to_all
FINISH_GATHER = "finish_gather"  # wait for it; owners cut their whole matrices out
NEWTON_SCHULZ = "newton_schulz"  # the batch's kept-local and owned units
START_SCATTER = "start_scatter"  # pack the results, start the scatter all_to_all
FINISH_SCATTER = "finish_scatter"  # wait for it; apply the returned blocks
COLLECTIVE_EVENTS = (START_GATHER, FINISH_GATHER, START_SCATTER, FINISH_SCATTER)


def batch_schedule(n_batches: int) -> tuple[tuple[str, int], ...]:
    """The owner exchange's order of events, ``(event, batch)``, for ``n_batches`` batches.

    Batch ``b``'s gather finishes, then gather ``b + 1`` starts, so it travels while this
    rank runs batch ``b``'s Newton-Schulz; scatter ``b`` starts once its results exist,
    and scatter ``b - 1`` finishes only after that, so it too travels during Newton-Schulz
    ``b``. At most three batches' buffers are alive at once.
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
