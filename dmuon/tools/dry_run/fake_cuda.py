"""One process as rank ``r`` of a CUDA job of any size, without a GPU.

A CUDA build of torch can make CUDA tensors that carry shape, dtype, device and
strides but no data (``FakeTensorMode``), and PyTorch's fake process group lets one
process be rank ``r`` of ``W`` ranks: every collective returns at once. Together they
run the real FSDP2, DTensor and DMuon code on the CUDA path, at any world size, on a
laptop. Without a driver, three functions of ``torch.cuda`` must answer as if one GPU
were there (:func:`pretend_one_gpu`), and torch.optim's list-path rule must take a fake
plain tensor as the plain tensor it stands for
(``dmuon.torch_compat.fake_tensors_take_the_list_path``); nothing else is replaced.

Use it for a model of your own::

    with fake_cuda_rank(rank=5, world_size=64) as mode:
        with torch.device("cuda"):
            model = MyModel()
        ...  # fully_shard, DMuon, grads, steps: see dmuon.tools.dry_run.run
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from dmuon.torch_compat import FakeTensorMode, fake_store, fake_tensors_take_the_list_path

# How to get a CUDA build, for the error on a CPU-only one.
CUDA_BUILD_HINT = (
    "install the registry's default torch build, e.g. `pip install torch==2.15.0` (the project's "
    "`DMUON_VENV=.venv-torch2.15 TORCH_VERSION=2.15.0 bash scripts/setup.sh` makes such an environment); "
    "no GPU or driver is needed"
)


class DryRunError(Exception):
    """Input the dry run cannot use; the message says what to do."""


def check_cuda_build() -> None:
    """A CPU-only torch cannot make fake CUDA tensors that FSDP2 can shard."""
    if torch.version.cuda is None:
        raise DryRunError(f"the dry run needs a CUDA build of torch, and torch {torch.__version__} is CPU-only: "
                          f"{CUDA_BUILD_HINT}")


def pretend_one_gpu() -> None:
    """Make ``torch.cuda`` answer as on a machine with one GPU, current device 0: the
    only replacements the dry run makes (FSDP2 and DeviceMesh ask these three)."""
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None


@contextlib.contextmanager
def fake_cuda_rank(rank: int, world_size: int, nccl_alone: bool = False) -> Iterator[FakeTensorMode]:
    """Be ``rank`` of ``world_size`` on a fake process group, inside a ``FakeTensorMode``
    that lets real CPU tensors in (meshes are CPU tensors). Tears the group down after."""
    check_cuda_build()
    if not 0 <= rank < world_size:
        raise DryRunError(f"rank {rank} is not in a world of {world_size} ranks; pass ranks 0..{world_size - 1}")
    pretend_one_gpu()
    fake_tensors_take_the_list_path()  # torch.optim's list-path rule, as for the real tensors
    if dist.is_initialized():
        dist.destroy_process_group()
    # "cuda:fake": a default group for CUDA tensors only, as NCCL alone (TorchTitan's GPU default).
    backend = "cuda:fake" if nccl_alone else "fake"
    dist.init_process_group(backend, store=fake_store(), rank=rank, world_size=world_size)
    # A real launcher selects each rank's GPU first; one process impersonating a rank has
    # one pretended GPU, which DeviceMesh's warning about it cannot know.
    warnings.filterwarnings("ignore", message="It seems like you did not set/select the default device")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        dist.destroy_process_group()
