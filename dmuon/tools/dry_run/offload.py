"""The waits a step under FSDP2's CPU offload documents (``--cpu-offload``; docs/dry_run.md,
"CPU offload"), counted from this rank's plan: what the recorder's count of the waits
``dmuon.exchange.host_staging`` announces must equal.

- the step's masks: one, before the masked momentum on the host;
- each batch whose results this rank receives: one, before it applies them;
- each unit this rank holds whole and keeps: one, before it applies its result;
- NorMuon's rows: one, after they were shared (``normuon``);
- QK-clip's factors: one, before the rows are scaled (``qk_clip_threshold``);
- the step's mask for the AdamW part on the host: one (``dmuon.step.adamw_part``).
"""

from __future__ import annotations

from dmuon.exchange.host_staging import ADAMW_MASK, KEPT, MASKS, NORMUON_ROWS, QK_CLIP_FACTORS, RESULTS
from dmuon.optimizer import DMuon


def documented_waits(optimizer: DMuon, options: dict) -> dict[str, int]:
    """The waits of one steady step of ``optimizer`` (run with DMuon ``options``), by kind."""
    run = optimizer.phases.fast_path.owner_run  # the dry run reads the plan it checks
    if run is None:
        return {}
    batches = run.plan.batches
    waits = {MASKS: 1,
             RESULTS: sum(bool(run.layout(batch).scatter_recv_units) for batch in batches),
             KEPT: sum(len(run.plan.kept_local(batch, run.rank)) for batch in batches),
             NORMUON_ROWS: int(bool(options.get("normuon"))),
             QK_CLIP_FACTORS: int(options.get("qk_clip_threshold") is not None),
             ADAMW_MASK: int(any(p.grad is not None for g in optimizer.param_groups if not g["use_muon"]
                                 for p in g["params"]))}
    return {kind: count for kind, count in waits.items() if count}
