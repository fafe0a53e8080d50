"""Execute an :class:`~dmuon.plan.OwnerPlan` with collectives.

One batch is two ``all_to_all_single`` calls on flat bf16 buffers:

- *gather*: every rank sends its rows of each matrix to the matrix's owner, and the
  owner concatenates the pieces in rank order into the full matrix (the same bf16
  values a single process would hold);
- *scatter*: each owner sends every rank its rows of the orthogonalized matrix.

Packing and unpacking are plain tensor code, separate from the collective, so they
can be tested by routing buffers between simulated ranks in one process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmuon.plan import OwnerPlan

WIRE_DTYPE = torch.bfloat16


@dataclass
class CommStats:
    """What this rank's fast path sent, summed over steps."""

    bytes_sent: int = 0
    """Bytes sent to other ranks (the share a rank keeps for itself does not count)."""
    collectives: int = 0
    """Number of ``all_to_all_single`` calls."""


def pack_gather(
    plan: OwnerPlan, matrices: Sequence[int], rank: int, local_rows: Mapping[int, torch.Tensor]
) -> torch.Tensor:
    """Flat send buffer for the gather: by owner rank, then in ``matrices`` order."""
    pieces: list[torch.Tensor] = []
    for owner in range(plan.world_size):
        pieces.extend(local_rows[i].reshape(-1) for i in matrices if plan.owners[i] == owner)
    return _concat(pieces, local_rows)


def unpack_gather(
    plan: OwnerPlan, matrices: Sequence[int], rank: int, recv: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Full matrices this rank owns, rebuilt from the gather's receive buffer."""
    owned = [i for i in matrices if plan.owners[i] == rank]
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in owned}
    offset = 0
    for source in range(plan.world_size):
        for i in owned:
            layout = plan.layouts[i]
            numel = layout.rows[source] * layout.row_numel
            pieces[i].append(recv[offset : offset + numel])
            offset += numel
    return {i: torch.cat(pieces[i]).view(plan.layouts[i].shape) for i in owned}


def pack_scatter(
    plan: OwnerPlan, matrices: Sequence[int], rank: int, results: Mapping[int, torch.Tensor]
) -> torch.Tensor:
    """Flat send buffer for the scatter: by destination rank, then in ``matrices`` order,
    that rank's rows of each matrix this rank owns."""
    owned = [i for i in matrices if plan.owners[i] == rank]
    # Row-major 2-D views, made contiguous once (a tall matrix comes back transposed).
    by_rows = {i: results[i].contiguous().view(-1, plan.layouts[i].row_numel) for i in owned}
    pieces: list[torch.Tensor] = []
    for dest in range(plan.world_size):
        for i in owned:
            rows = plan.layouts[i].rows
            start = sum(rows[:dest])
            pieces.append(by_rows[i][start : start + rows[dest]].reshape(-1))
    return _concat(pieces, results)


def unpack_scatter(
    plan: OwnerPlan, matrices: Sequence[int], rank: int, recv: torch.Tensor
) -> dict[int, torch.Tensor]:
    """This rank's rows of every matrix in ``matrices``, from the scatter's receive buffer."""
    local: dict[int, torch.Tensor] = {}
    offset = 0
    for owner in range(plan.world_size):
        for i in matrices:
            if plan.owners[i] != owner:
                continue
            layout = plan.layouts[i]
            numel = layout.rows[rank] * layout.row_numel
            local[i] = recv[offset : offset + numel].view((layout.rows[rank],) + layout.shape[1:])
            offset += numel
    return local


def _concat(pieces: list[torch.Tensor], like: Mapping[int, torch.Tensor]) -> torch.Tensor:
    if pieces:
        return torch.cat(pieces)
    device = next(iter(like.values())).device if like else torch.device("cpu")
    return torch.empty(0, dtype=WIRE_DTYPE, device=device)


class Exchange:
    """An ``all_to_all_single`` in flight: ``wait()`` returns the receive buffer."""

    def __init__(
        self,
        send: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup,
        group_rank: int,
        stats: CommStats,
    ) -> None:
        self.send_splits, self.recv_splits = send_splits, recv_splits
        self.recv = torch.empty(sum(recv_splits), dtype=WIRE_DTYPE, device=send.device)
        # Keep the send buffer alive until the collective is done.
        self._send = send
        self._work = dist.all_to_all_single(
            self.recv, send, recv_splits, send_splits, group=group, async_op=True
        )
        stats.collectives += 1
        stats.bytes_sent += (sum(send_splits) - send_splits[group_rank]) * send.element_size()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._send = None
        return self.recv
