"""The process group of each rank set DMuon runs device collectives on (the owner
exchange, the grads' status, QK-clip's logits, NorMuon's rows). No collective of DMuon's
runs on the host, so it needs no group that takes CPU tensors.

A group is the default group or a mesh's own whenever one has exactly the ranks; an n-D
mesh of a subset (a pipeline stage's) is flattened as DeviceMesh flattens its own dims,
every rank of the root mesh taking part, so no rank waits in a group creation its peers
skip (a hang under eager NCCL, ``init_process_group(device_id=...)``). Only a mesh
without dim names, which cannot be flattened, gets a group made by its members alone,
once per rank set, at planning.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon.plan.mesh_facts import mesh_ranks
from dmuon.torch_compat import flattened_group

# DMuon's own name for an n-D mesh flattened (it meets no name a training script gave).
FLAT_MESH_PREFIX = "dmuon_"

# Groups made for rank sets, per default group: a group dies with the default group
# (``dist.destroy_process_group()``), so a new default group starts a new cache and the
# old one goes with the old default group (weak key). Keys: ranks.
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def group_of(ranks: tuple[int, ...], meshes: Sequence[DeviceMesh]) -> dist.ProcessGroup:
    """A process group of exactly ``ranks`` for device collectives (module docstring)."""
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    for mesh in meshes:
        if mesh.ndim == 1 and mesh_ranks(mesh) == ranks:
            return mesh.get_group()
    for mesh in meshes:
        if mesh_ranks(mesh) == ranks and mesh.mesh_dim_names:
            return flattened_group(mesh, FLAT_MESH_PREFIX + "_".join(mesh.mesh_dim_names))
    return _made(ranks)


def _made(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    made = _GROUPS.setdefault(dist.group.WORLD, {})
    if ranks not in made:
        made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return made[ranks]
