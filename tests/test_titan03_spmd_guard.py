"""DMuon refuses what it cannot see whole: a plain-tensor parameter that
``spmd_types`` marks as differing across the ranks of a mesh axis (how TorchTitan
0.3.x's ``spmd_types`` backend holds a TP shard before FSDP turns it into a DTensor).
Two CPU ranks (gloo). Skipped unless TorchTitan 0.3.x is installed.
"""

from __future__ import annotations

import pytest

from tests.titan03_support import require_titan03

require_titan03()

from tests.multiprocess import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.multirank


def _build_with_annotation(kind: str) -> str:
    """Annotate ``layers.0.attention.wo.weight`` on a 2-rank ``tp`` axis; build the container;
    its error message, or "" when it builds."""
    import spmd_types as spmd
    from torch.distributed.device_mesh import init_device_mesh

    from tests.titan03_support import ToyLlama3
    from torchtitan_ext.titan03.optimizer import dmuon_optimizer

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    axis = spmd.MeshAxis.of(mesh.get_group("tp"))
    model = ToyLlama3()
    spmd.assert_type(model.layers["0"].attention.wo.weight, {axis: spmd.S(0) if kind == "shard" else spmd.R})
    try:
        dmuon_optimizer().build(model_parts=[model])
    except ValueError as error:
        return str(error)
    return ""


def test_a_plain_tensor_sharded_by_spmd_types_is_refused_by_name():
    for message in run_on_ranks(_build_with_annotation, 2, "shard"):
        assert "'layers.0.attention.wo.weight' is a plain tensor that spmd_types marks" in message
        assert "spmd_backend" in message


def test_a_plain_tensor_replicated_by_spmd_types_is_accepted():
    assert run_on_ranks(_build_with_annotation, 2, "replicate") == ["", ""]
