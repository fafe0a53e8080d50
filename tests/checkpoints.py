"""The DCP checkpoints TorchTitan jobs write (``<dump folder>/checkpoint/step-N``), read
offline and compared bit for bit.

A checkpoint is loaded whole, as full tensors, without a process group
(``dcp_to_torch_save``), whatever the ranks and layout that wrote it. TorchTitan keeps
the model's weights at its top level under their parameter names, and the optimizer's
state under ``"optimizer"`` with flat keys (``state.<param>.<name>``,
``param_groups.<param>.<option>``); both lines (0.2.x and 0.3.x) write that layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

__all__ = ["assert_same_checkpoints", "assert_same_tensors", "checkpoint_dir", "load_checkpoint"]

# What a TorchTitan checkpoint holds beside the model's weights.
NON_MODEL_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def checkpoint_dir(run: Path, step: int) -> Path:
    """Where a run with dump folder ``run`` keeps its checkpoint of ``step``."""
    return run / "checkpoint" / f"step-{step}"


def load_checkpoint(folder: Path, scratch: Path) -> dict:
    """A DCP checkpoint as full tensors, read offline (no process group needed);
    ``scratch`` is a folder for the converted copy."""
    scratch.mkdir(parents=True, exist_ok=True)
    converted = scratch / f"{folder.name}.pt"
    dcp_to_torch_save(folder, converted)
    return torch.load(converted, weights_only=False)


def assert_same_tensors(actual: dict, expected: dict) -> None:
    """``actual`` and ``expected`` (nested dicts) hold tensors under the same keys, bitwise equal."""
    actual_tensors, expected_tensors = _tensors(actual), _tensors(expected)
    assert actual_tensors.keys() == expected_tensors.keys()
    assert expected_tensors, "no tensors to compare"
    differing = [k for k, t in expected_tensors.items()
                 if t.dtype != actual_tensors[k].dtype or not torch.equal(t, actual_tensors[k])]
    assert not differing, f"{len(differing)} of {len(expected_tensors)} tensors differ: {differing[:5]}"


def assert_same_checkpoints(actual: Path, expected: Path, scratch: Path) -> None:
    """The checkpoint folders ``actual`` and ``expected`` hold the same tensors, bitwise:
    every weight of the model and every tensor of the optimizer's state (momentum
    buffers, AdamW moments and steps)."""
    loaded = {name: load_checkpoint(folder, scratch / name) for name, folder in
              (("actual", actual), ("expected", expected))}
    model = {k: v for k, v in loaded["expected"].items() if k not in NON_MODEL_STATES}
    assert _tensors(model), f"{expected} holds no model weights"
    assert any(k.endswith("momentum_buffer") for k in _tensors(loaded["expected"].get("optimizer", {}))), (
        f"{expected} holds no optimizer state (a model-only checkpoint?)")
    assert_same_tensors(loaded["actual"], loaded["expected"])


def _tensors(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            found[prefix + str(key)] = value
        elif isinstance(value, dict):
            found.update(_tensors(value, f"{prefix}{key}/"))
    return found
