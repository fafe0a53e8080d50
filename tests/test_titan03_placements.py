"""DMuon on the parameters TorchTitan 0.3.x's own parallelize functions make, under
every ``parallelism.spmd_backend``, on CPU ranks (gloo).

``scripts/show_layouts_titan03.py`` builds the debug model (llama3; qwen3's MoE
flavor for EP) as the Trainer does and prints each parameter's placement; these
tests build the same models, then the DMuon container, and check that every
parameter is a DTensor (no backend hands over a secretly sharded plain tensor),
that every Muon matrix takes the owner exchange (``all_to_all``), and that one
step runs and moves every parameter to finite values. No forward or backward runs
(FlexAttention has no CPU backward): the gradients are set by hand. The models keep their
first two transformer blocks (``--layers 2``): every block is parallelized alike, and the
full debug MoE model (315M elements, 8 blocks) spent most of its launch in DMuon's step.
"""

from __future__ import annotations

import importlib.util
from argparse import Namespace
from pathlib import Path

import pytest

from tests.titan03_support import require_titan03

require_titan03()

from tests.multiprocess import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.multirank

BACKENDS = ("spmd_types", "full_dtensor", "partial_dtensor")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "show_layouts_titan03.py"
# name: (ranks, model, flavor, dp_replicate, dp_shard, tp, ep)
LAYOUTS = {
    "fsdp_2": (2, "llama3", "debugmodel", 1, -1, 1, 1),
    "tp_2": (2, "llama3", "debugmodel", 1, 1, 2, 1),
    "moe_ep_2": (2, "qwen3", "debugmodel_moe", 1, -1, 1, 2),
    "hsdp_2x2": (4, "llama3", "debugmodel", 2, 2, 1, 1),
    "fsdp_2_x_tp_2": (4, "llama3", "debugmodel", 1, 2, 2, 1),
}
TIMEOUT_S = 600.0
LAYERS = 2  # transformer blocks built: the same placements as all of them


def _script():
    spec = importlib.util.spec_from_file_location("show_layouts_titan03", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_step(backend: str, model: str, flavor: str, dp_replicate: int, dp_shard: int, tp: int, ep: int) -> dict:
    """On each rank: {"plain": [...], "paths": {...}, "moved_and_finite": bool}. One
    backend per process: TorchTitan keeps its meshes in process-wide state."""
    import torch
    from torch.distributed.tensor import DTensor

    from torchtitan_ext.titan03.optimizer import dmuon_optimizer

    script = _script()
    script.use_cpu_meshes()
    built = script.build_model(Namespace(backend=backend, model=model, flavor=flavor, dp_replicate=dp_replicate,
                                         dp_shard=dp_shard, tp=tp, ep=ep, layers=LAYERS))
    optimizer = dmuon_optimizer(factory_options={"ns_dtype": "float32"}).build(model_parts=[built]).optimizers[0]
    params = dict(built.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    for p in params.values():
        p.grad = torch.full_like(p, 0.01)
    optimizer.step()
    # Each rank checks its own shards (every rank reports): no all-gather of the whole model.
    moved = all(not torch.equal(before[n], p.detach()) and bool(torch.isfinite(p.detach().to_local()).all())
                for n, p in params.items())
    return {"plain": [n for n, p in params.items() if not isinstance(p, DTensor)],
            "paths": optimizer.comm_paths(), "moved_and_finite": moved}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parameters_are_dtensors_and_every_muon_matrix_takes_the_owner_exchange(layout, backend):
    ranks, *shape = LAYOUTS[layout]
    for found in run_on_ranks(_one_step, ranks, backend, *shape, timeout=TIMEOUT_S, fresh=True):
        assert found["plain"] == []
        assert found["paths"] and set(found["paths"].values()) == {"all_to_all"}, found["paths"]
        assert found["moved_and_finite"]
