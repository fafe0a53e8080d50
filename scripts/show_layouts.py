"""Print how TorchTitan lays out every parameter after its own ``parallelize``.

    OMP_NUM_THREADS=1 PYTHONPATH=. torchrun --standalone --nproc-per-node 4 \
        scripts/show_layouts.py --job.config_file train_configs/llama3_debug_dmuon.toml \
        --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2

Every argument except ``--filter REGEX`` (print only parameters whose name matches)
goes to TorchTitan's config parser, exactly as for ``-m torchtitan.train``. The
script builds TorchTitan's ``Trainer`` -- so the model goes through the same
``parallelize_fn`` (TP, EP, FSDP/HSDP, ``torchtitan_ext``'s wrappers) a training
run uses -- then prints one line per parameter on rank 0 and exits without training:

    name | type | mesh dim names | mesh shape | placements | global shape | rank 0 local shape

With pipeline parallelism each stage holds different parameters; only rank 0's
stage is printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def layout_rows(model_parts, name_filter: re.Pattern[str] | None = None) -> list[tuple[str, ...]]:
    """One row of strings per parameter: the columns the module docstring lists."""
    rows = []
    for part in model_parts:
        for name, p in part.named_parameters():
            if name_filter and not name_filter.search(name):
                continue
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                rows.append((name, type(p).__name__, str(mesh.mesh_dim_names), str(tuple(mesh.shape)),
                             str(tuple(p.placements)), str(tuple(p.shape)), str(tuple(p.to_local().shape))))
            else:  # e.g. DDP-only or single-rank runs: plain tensors, no mesh
                rows.append((name, type(p).__name__, "-", "-", "-", str(tuple(p.shape)), str(tuple(p.shape))))
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--filter", default=None)
    ours, titan_args = parser.parse_known_args(argv)

    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    config = ConfigManager().parse_args(titan_args)
    trainer = Trainer(config)
    try:
        rows = layout_rows(trainer.model_parts, re.compile(ours.filter) if ours.filter else None)
        if dist.get_rank() == 0:
            print(f"world size {dist.get_world_size()}, parallel dims: "
                  f"dp_replicate={trainer.parallel_dims.dp_replicate} dp_shard={trainer.parallel_dims.dp_shard} "
                  f"tp={trainer.parallel_dims.tp} ep={trainer.parallel_dims.ep} etp={trainer.parallel_dims.etp} "
                  f"pp={trainer.parallel_dims.pp}")
            for row in rows:
                print(" | ".join(row))
    finally:
        trainer.close()
    dist.destroy_process_group()
    # End without interpreter finalization, as torchtitan_ext.titan02.cpu_compat does for
    # torchtitan.train (patch 4): gloo's worker threads may otherwise abort the
    # process while it shuts down.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
