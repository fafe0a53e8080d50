"""The process groups DMuon runs its collectives on, one per rank set, and the one
agreement it makes on the host.

Two kinds of collective, two kinds of group:

- *device* collectives (the owner exchange, QK-clip's logits, NorMuon's rows) move
  tensors on the mesh's device: :func:`group_of` gives a group of exactly the ranks;
- *host* agreements (which grads exist, whether a shard is the block the plan
  assumes, which attentions reported logits) are decided from Python facts every rank
  already has. :func:`sum_on_host` sums a few integers over a group that takes CPU
  tensors (:func:`host_group_of`), so no device value is read on the host: a step
  never waits for the GPU to finish its backward before it can queue its own kernels.

A default group that takes CPU tensors (``gloo``, ``"cpu:gloo,cuda:nccl"``, the fake
group of ``dmuon.dry_run``) serves both; under NCCL alone, DMuon makes one ``gloo``
group per rank set, once. Groups are made only by their member ranks
(``use_local_synchronization``), so pipeline stages, each with its own optimizer and
ranks, need not make theirs together.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon.plan.mesh_facts import mesh_ranks
from dmuon.torch_compat import flattened_group, host_tensor_ops

# The name of the flattened mesh DMuon asks an n-D mesh for (its own, so it meets no
# name a training script gave its meshes).
FLAT_MESH_PREFIX = "dmuon_"
# The backend DMuon adds for host agreements when the default group takes no CPU tensors.
HOST_BACKEND = "gloo"

# Groups made for rank sets, per default group: a group dies with the default group
# (``dist.destroy_process_group()``), so a new default group starts a new cache and the
# old one goes with the old default group (weak key). Keys: (kind, ranks).
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[str, tuple[int, ...]], dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def group_of(ranks: tuple[int, ...], meshes: Sequence[DeviceMesh]) -> dist.ProcessGroup:
    """A process group of exactly ``ranks`` for device collectives: the default group or
    a 1-D mesh's group when one has them; for an n-D mesh of these ranks (a pipeline
    stage's), its flattened mesh's group (every rank of the root mesh makes it together,
    as under ``init_process_group(device_id=...)``'s eager NCCL every rank must); else, for
    a mesh without dim names, a group made once per rank set by its members only."""
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    for mesh in meshes:
        if mesh.ndim == 1 and mesh_ranks(mesh) == ranks:
            return mesh.get_group()
    for mesh in meshes:
        if mesh_ranks(mesh) == ranks and mesh.mesh_dim_names:
            return flattened_group(mesh, FLAT_MESH_PREFIX + "_".join(mesh.mesh_dim_names))
    return _made("device", ranks, backend=None)


def takes_cpu_tensors(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s backend runs collectives on CPU tensors (gloo, fake, or a
    ``"cpu:gloo,cuda:nccl"`` pair; not NCCL alone)."""
    config = dist.get_backend_config(group)
    return "cpu:" in config or config in ("gloo", "fake")


def host_group_of(ranks: tuple[int, ...], meshes: Sequence[DeviceMesh] = ()) -> dist.ProcessGroup:
    """A process group of exactly ``ranks`` that takes CPU tensors: the device group when
    its backend does (gloo, fake), else a ``gloo`` group made once per rank set."""
    if takes_cpu_tensors(dist.group.WORLD):
        return group_of(ranks, meshes)
    return _made("host", ranks, backend=HOST_BACKEND)


def sum_on_host(values: Sequence[int], group: dist.ProcessGroup | None) -> list[int]:
    """``values`` summed elementwise over ``group`` (a :func:`host_group_of` group; None:
    this rank alone). A CPU tensor, real also under a ``FakeTensorMode``: the sums are
    read on the host without any device work."""
    with host_tensor_ops():
        summed = torch.tensor(list(values), dtype=torch.int64)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(summed, group=group)
        return summed.tolist()


def _made(kind: str, ranks: tuple[int, ...], backend: str | None) -> dist.ProcessGroup:
    made = _GROUPS.setdefault(dist.group.WORLD, {})
    if (kind, ranks) not in made:
        made[kind, ranks] = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
    return made[kind, ranks]
