"""The embedded corpus (``torchtitan_ext.corpus``) as TorchTitan 0.2.x datasets.

Two TorchTitan dataset names are registered (in TorchTitan's own ``DATASETS``
table, the documented extension point of ``torchtitan.hf_datasets.text_datasets``):

* ``pydoc``            -> ``[training] dataset``: the training split,
* ``pydoc_validation`` -> ``[validation] dataset``: the held-out split.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.tools.logging import logger

from ..corpus import CORPUS_PATH, load_split, TRAIN_DATASET, VALIDATION_DATASET


def _as_hf_dataset(split: str, path: str) -> Dataset:
    # A map-style ``datasets.Dataset`` makes TorchTitan resume by sample index,
    # which is exact and cheap; ``split_dataset_by_node`` then gives each data-
    # parallel rank a contiguous, disjoint shard.
    texts = load_split(split, path)
    logger.info(f"Embedded corpus {path}: {len(texts)} {split} chunks")
    return Dataset.from_dict({"text": texts})


def _text_of(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Add ``pydoc`` and ``pydoc_validation`` to TorchTitan's dataset table.

    ``[training] dataset_path`` / ``[validation] dataset_path`` may point to another
    file in the same format to use other text.
    """
    DATASETS[TRAIN_DATASET] = DatasetConfig(
        path=str(CORPUS_PATH),
        loader=lambda path: _as_hf_dataset("train", path),
        sample_processor=_text_of,
    )
    DATASETS[VALIDATION_DATASET] = DatasetConfig(
        path=str(CORPUS_PATH),
        loader=lambda path: _as_hf_dataset("validation", path),
        sample_processor=_text_of,
    )


def rewind_validation_before_each_run(validator: Any) -> Any:
    """Make every validation pass score the same held-out batches.

    TorchTitan's validator keeps one data iterator for the whole job, so with
    ``[validation] steps > 0`` each pass reads the *next* batches and the curve
    mixes progress with sampling noise. We snapshot the validation dataloader's
    state once and restore it before every pass. The training data is untouched.
    """
    loader = getattr(validator, "validation_dataloader", None)
    if loader is None or not hasattr(loader, "state_dict"):
        return validator
    initial_state = loader.state_dict()
    original_validate = validator.validate

    def validate(*args: Any, **kwargs: Any) -> Any:
        loader.load_state_dict(initial_state)
        return original_validate(*args, **kwargs)

    validator.validate = validate
    return validator
