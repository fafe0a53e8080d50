"""Host-side facts of a ``DeviceMesh``: its ranks, read once and kept.

``DeviceMesh.mesh`` is a CPU tensor: under a ``FakeTensorMode`` (the dry run, memory
estimators) reading it would give fake tensors whose values cannot be read, so it runs on
real CPU tensors here (``dmuon.torch_compat.host_tensor_ops``); no device-to-host sync.
"""

from __future__ import annotations

import weakref

from torch.distributed.device_mesh import DeviceMesh

from dmuon.torch_compat import host_tensor_ops

# Read once per mesh object: a step asks every time, the answer never changes.
_RANKS: weakref.WeakKeyDictionary[DeviceMesh, tuple[int, ...]] = weakref.WeakKeyDictionary()


def mesh_ranks_in_order(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of ``mesh`` in row-major mesh order (coordinate order)."""
    ranks = _RANKS.get(mesh)
    if ranks is None:
        with host_tensor_ops():
            ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        _RANKS[mesh] = ranks
    return ranks


def mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of ``mesh``, sorted."""
    return tuple(sorted(mesh_ranks_in_order(mesh)))
