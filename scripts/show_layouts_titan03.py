"""Print what TorchTitan 0.3.x makes of each parameter under one parallelism layout.

Builds a debug model of TorchTitan's own registry on the meta device, parallelizes
it with the model's own ``parallelize_fn`` (as the Trainer does), materializes it
on CPU and prints, from rank 0, each parameter's type, mesh and placements, and
whether DMuon's layout reader accepts it and which path DMuon would choose.
No training step runs, so FlexAttention's missing CPU backward does not matter.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/show_layouts_titan03.py \\
        --backend spmd_types --tp 2 --dp-shard 1

``--model qwen3 --flavor debugmodel_moe --ep 2`` shows expert parallelism.
"""

from __future__ import annotations

import argparse
import importlib
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

BACKENDS = ("spmd_types", "full_dtensor", "partial_dtensor")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="spmd_types")
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--all", action="store_true", help="every parameter, not only layer 0 and the rest")
    parser.add_argument("--layers", type=int, default=None,
                        help="build only the first N transformer blocks (every block is placed alike)")
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The registry's model, parallelized by its own ``parallelize_fn`` and put on CPU."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallelism = ParallelismConfig(
        spmd_backend=args.backend, data_parallel_replicate_degree=args.dp_replicate,
        data_parallel_shard_degree=args.dp_shard, tensor_parallel_degree=args.tp,
        expert_parallel_degree=args.ep,
    )
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dist_utils.set_spmd_backend(args.backend)
    spec = importlib.import_module(f"torchtitan.models.{args.model}").model_registry(args.flavor)
    if getattr(args, "layers", None):  # fewer blocks, the same placements: each block is parallelized alike
        spec.model.layers = spec.model.layers[: args.layers]
    training = TrainingConfig(local_batch_size=2, seq_len=64, steps=1)
    # Sets each module's sharding config from the parallelism (as the Trainer does).
    spec.model.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp",
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def describe(param: torch.Tensor) -> str:
    """Type, mesh and placements, and the local shape beside the global one."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        return (f"DTensor mesh={mesh.mesh_dim_names}{tuple(mesh.shape)} placements={tuple(param.placements)} "
                f"global={tuple(param.shape)} local={tuple(param.to_local().shape)}")
    return f"{type(param).__name__} shape={tuple(param.shape)}"


def dmuon_view(name: str, param: torch.Tensor) -> str:
    """What DMuon makes of it: its path, or the error that refuses it."""
    from dmuon.plan import comm_path

    if param.ndim < 2:
        return "AdamW (ndim < 2)"
    try:
        return f"path={comm_path(param, 'all_to_all')}"
    except (ValueError, NotImplementedError) as error:
        return f"refused: {error}"


def use_cpu_meshes() -> None:
    """TorchTitan 0.3.0 picks its mesh device type at import and falls back to "cuda"
    when torch sees no accelerator; on a CPU machine the meshes must be "cpu" (gloo).
    A script-local setting: this script runs no training step."""
    if not torch.cuda.is_available():
        import torchtitan.distributed.parallel_dims as parallel_dims

        parallel_dims.device_type = "cpu"


def main() -> None:
    args = parse_args()
    use_cpu_meshes()
    dist.init_process_group("gloo")
    model = build_model(args)
    if dist.get_rank() == 0:
        print(f"== backend={args.backend} model={args.model}/{args.flavor} dp_replicate={args.dp_replicate} "
              f"dp_shard={args.dp_shard} tp={args.tp} ep={args.ep} world={dist.get_world_size()}")
        for name, param in model.named_parameters():
            if args.all or ".layers." not in f".{name}" or ".0." in f".{name}":
                print(f"{name}: {describe(param)}  [{dmuon_view(name, param)}]")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
