"""Which path each Muon parameter takes, decided here and nowhere else.

- ``local``: the rank holds the whole parameter (plain tensor, replicated DTensor,
  one-rank mesh); it orthogonalizes its own update in place and nothing moves;
- ``all_to_all``: the owner exchange (``dmuon.transport.owner_exchange``) over one
  owner plan (``dmuon.fast_path``);
- ``redistribute``: every rank gathers and orthogonalizes the whole parameter
  (``dmuon.transport.reference``).

Two rules decide it: the parameter's own placement (``dmuon.plan.comm_path``: what the
plan can describe), then the optimizer's one plan: it spans the ranks of the first
fast parameter's mesh, so a fast parameter on a mesh of other ranks is sent to the
reference path. Both read types and placements only, so every rank of a mesh chooses
the same and no collective is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dmuon.mesh_facts import mesh_ranks
from dmuon.plan import ALL_TO_ALL, LOCAL, REDISTRIBUTE, comm_path

# The order the chosen paths are logged in.
PATHS = (ALL_TO_ALL, REDISTRIBUTE, LOCAL)


def choose_paths(
    muon_params: Sequence[torch.Tensor], comm: str, name_of: Callable[[torch.Tensor], str]
) -> dict[torch.Tensor, str]:
    """Each Muon parameter's path, in order; a ``ValueError`` names a parameter no path
    can step (a ``Partial`` placement)."""
    paths: dict[torch.Tensor, str] = {}
    for param in muon_params:
        try:
            paths[param] = comm_path(param, comm)
        except ValueError as error:
            raise ValueError(f"DMuon: parameter {name_of(param)!r}: {error}") from None
    fast = [p for p, path in paths.items() if path == ALL_TO_ALL]
    for param in fast[1:]:
        if mesh_ranks(param.device_mesh) != mesh_ranks(fast[0].device_mesh):
            paths[param] = REDISTRIBUTE
    return paths
