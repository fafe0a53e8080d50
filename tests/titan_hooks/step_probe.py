"""A probe for TorchTitan jobs of either line (0.2.x, 0.3.x): after every training step,
each rank appends one JSON line to ``<folder>/rank<r>.jsonl`` with what the step left
(``step_record``). Armed by ``install_from_env`` when ``DMUON_SWITCH_PROBE=<folder>`` is
set: from ``tests/titan_hooks/switch_probe.py`` (0.2.x's custom_import) or a 0.3.x config
module (``tests/titan03_switches.py``). Read back by ``tests/titan_switches.py``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

PROBE_ENV = "DMUON_SWITCH_PROBE"
# The attribute names torch.compile and activation checkpointing wrap a module under.
WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def _unwrapped(name: str) -> str:
    """``name`` as the plain model spells it (``layers.0._orig_mod.attention`` -> ``layers.0.attention``)."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's plain tensor of ``param``: its DTensor shard, unwrapped from torchao's
    float8 weight wrapper (which holds the high-precision weight as ``_tensor``)."""
    local = param._local_tensor if isinstance(param, DTensor) else param  # to_local() makes a new view
    return getattr(local, "_tensor", local)


def _digest(model_parts: list[torch.nn.Module]) -> str:
    """SHA-256 of this rank's parameter shards, by name: equal digests, equal bits."""
    sha = hashlib.sha256()
    for model in model_parts:
        for name, param in model.named_parameters():
            sha.update(_unwrapped(name).encode())
            sha.update(_shard(param).detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _block_compiles(model_parts: list[torch.nn.Module]) -> tuple[int, int]:
    """(how many forwards of the transformer blocks Dynamo compiled, how many times it
    recompiled one). 0.2.x wraps each block (``torch.compile(block)``): the compiled code
    is the block's forward or, under activation checkpointing, its wrapper's (layer-wise
    selective AC wraps every other block: two forwards). 0.3.x compiles each block in
    place (``block.compile()``): the compiled code is again the block's forward. 0 and 0 in
    eager. One version of each serves every block when nothing in it differs between blocks."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list, OptimizedModule

    codes = set()
    for model in model_parts:
        for block in getattr(model, "layers", {}).values():
            if isinstance(block, OptimizedModule):
                codes.add(type(block._orig_mod).forward.__code__)
            elif getattr(block, "_compiled_call_impl", None) is not None:
                codes.add(type(block).forward.__code__)  # Dynamo steps over _call_impl into forward
    versions = [len(_debug_get_cache_entry_list(code)) for code in codes]
    return sum(v > 0 for v in versions), sum(max(v - 1, 0) for v in versions)


def _current_float8_scales(weights: list[torch.Tensor]) -> int:
    """How many of the float8 ``weights`` (local ``WeightWithDynamicFloat8CastTensor``
    shards) hold, as their precomputed scale, exactly the scale torchao's dynamic cast
    would compute from the whole weight now (its amax over every rank: one all-reduce,
    which every rank runs here alike). 0 when a scale is missing or stale."""
    if not weights or any(getattr(w, "_precomputed_scale", None) is None for w in weights):
        return 0
    import torch.distributed as dist
    from torchao.float8.float8_utils import amax_to_scale

    amax = torch.stack([w._tensor.abs().max().float() for w in weights])
    if dist.is_initialized():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    expected = amax_to_scale(amax, torch.float8_e4m3fn)
    held = torch.stack([w._precomputed_scale.reshape(()) for w in weights])
    return int((held == expected).sum())


def step_record(trainer: Any, loss: float | None) -> dict[str, Any]:
    """What one training step left on this rank: the logged loss, a digest of the
    parameter shards, each attention's per-head largest logit (DMuon's
    ``last_max_logits``), the local tensor types of the Muon weights and how many hold
    a precomputed float8 scale (and how many are the current one), the dtypes of the
    parameters DMuon updates, and Dynamo's counts (compiled block forwards, recompiles,
    graph breaks)."""
    from torch._dynamo.utils import counters

    optimizers = list(trainer.optimizers.optimizers)
    muon = [p for opt in optimizers for g in opt.param_groups if g.get("use_muon") for p in g["params"]]
    locals_ = [p._local_tensor if isinstance(p, DTensor) else p for p in muon]  # to_local() makes a new view
    max_logits = {_unwrapped(name): values.tolist()
                  for opt in optimizers for name, values in getattr(opt, "last_max_logits", dict)().items()}
    compiled, recompiles = _block_compiles(trainer.model_parts)
    return {
        "step": trainer.step,
        "loss": loss,
        "digest": _digest(trainer.model_parts),
        "max_logits": max_logits,
        "muon_weights": len(muon),
        "muon_local_types": sorted({type(t).__name__ for t in locals_}),
        "float8_scales_set": sum(getattr(t, "_precomputed_scale", None) is not None for t in locals_),
        "float8_scales_current": _current_float8_scales([t for t in locals_ if hasattr(t, "_precomputed_scale")]),
        "float8_linears": sum("Float8Linear" in type(m).__name__ for model in trainer.model_parts
                              for m in model.modules()),
        "param_dtypes": sorted({str(p.dtype) for opt in optimizers for g in opt.param_groups for p in g["params"]}),
        "compiled_block_forwards": compiled,
        "block_recompiles": recompiles,
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _trainer_class() -> type:
    """The Trainer class the running job uses: 0.2.x's ``python -m torchtitan.train`` runs
    that module as ``__main__`` (its Trainer is not the one ``import torchtitan.train``
    would load again); 0.3.x's lives in ``torchtitan.trainer``."""
    from torchtitan_ext.versions import torchtitan_line

    if torchtitan_line() == "0.3":
        from torchtitan.trainer import Trainer

        return Trainer
    main = sys.modules["__main__"]
    if hasattr(main, "Trainer"):
        return main.Trainer
    from torchtitan.train import Trainer

    return Trainer


def install_probe(folder: Path) -> None:
    """Wrap ``Trainer.train_step`` (and the metrics processor's ``log``, for the exact
    loss it is given) to append ``step_record`` to ``folder/rank<r>.jsonl`` after each step."""
    from torchtitan.components.metrics import MetricsProcessor

    trainer_class = _trainer_class()

    logged: dict[int, float] = {}
    original_log = MetricsProcessor.log

    @functools.wraps(original_log)
    def log(self: Any, step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> None:
        logged[step] = float(global_avg_loss)
        return original_log(self, step, global_avg_loss, *args, **kwargs)

    original_step = trainer_class.train_step
    path = folder / f"rank{os.environ.get('RANK', '0')}.jsonl"

    @functools.wraps(original_step)
    def train_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_step(self, *args, **kwargs)
        with torch.no_grad(), path.open("a") as out:
            out.write(json.dumps(step_record(self, logged.get(self.step))) + "\n")
        return result

    MetricsProcessor.log = log
    trainer_class.train_step = train_step



def install_from_env() -> None:
    """``install_probe`` into ``$DMUON_SWITCH_PROBE`` when it is set."""
    if PROBE_ENV in os.environ:
        install_probe(Path(os.environ[PROBE_ENV]))
