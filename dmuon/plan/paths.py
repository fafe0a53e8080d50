"""Which path each Muon parameter takes, decided here and nowhere else: ``local`` (the
rank holds the whole parameter and orthogonalizes it in place), ``all_to_all`` (the owner
exchange, ``dmuon.exchange.owner_exchange``) or ``redistribute`` (every rank gathers the
whole parameter, ``dmuon.exchange.reference``).

Two rules decide it: the parameter's own placement (:func:`comm_path`: what the
plan can describe), then the optimizer's one plan: it spans the ranks of the first
fast parameter's mesh, so a fast parameter on a mesh of other ranks is sent to the
reference path. Both read types and placements only, so every rank of a mesh chooses
the same and no collective is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from dmuon.plan.cutting import layout_problem
from dmuon.plan.layout import Layout
from dmuon.plan.mesh_facts import mesh_ranks, mesh_ranks_in_order

LOCAL = "local"
ALL_TO_ALL = "all_to_all"
REDISTRIBUTE = "redistribute"
COMM_CHOICES = (ALL_TO_ALL, REDISTRIBUTE)
PATHS = (ALL_TO_ALL, REDISTRIBUTE, LOCAL)  # the order the chosen paths are logged in


def comm_path(param: torch.Tensor, comm: str) -> str:
    """The path a Muon parameter's placement allows, given ``comm`` (``"all_to_all"`` or
    ``"redistribute"``): the first rule of :func:`choose_paths`. ``ValueError`` for ``Partial``."""
    if not isinstance(param, DTensor):
        return LOCAL
    placements = param.placements
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"a Partial placement {placements} cannot hold a parameter")
    if all(isinstance(p, Replicate) for p in placements):
        return LOCAL
    if comm == REDISTRIBUTE:
        return REDISTRIBUTE
    if param.device_mesh.size() == 1:
        return LOCAL
    return REDISTRIBUTE if layout_problem(param.shape, layout_of(param)) else ALL_TO_ALL


def layout_of(param: DTensor, plan_rank: Mapping[int, int] | None = None) -> Layout:
    """A DTensor's layout; ``plan_rank`` maps global ranks to plan ranks (default: same)."""
    mesh = param.device_mesh
    ranks = list(mesh_ranks_in_order(mesh))
    if plan_rank is not None:
        ranks = [plan_rank[r] for r in ranks]
    return Layout(tuple(mesh.shape), tuple(param.placements), tuple(ranks))


def choose_paths(muon_params: Sequence[torch.Tensor], comm: str,
                 name_of: Callable[[torch.Tensor], str]) -> dict[torch.Tensor, str]:
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
