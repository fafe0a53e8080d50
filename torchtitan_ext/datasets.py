"""The embedded corpus (``torchtitan_ext.corpus``) as TorchTitan datasets, for both lines.

Two names are added to TorchTitan's own ``DATASETS`` table (the documented extension
point of ``torchtitan.hf_datasets.text_datasets``, the same in 0.2.x and 0.3.x):

* ``pydoc``            -> the training split,
* ``pydoc_validation`` -> the held-out split.

0.2.x's job module registers them at job start; 0.3.x's ``PydocDataLoader`` when it
is built.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.tools.logging import logger

from .corpus import CORPUS_PATH, load_split, TRAIN_DATASET, VALIDATION_DATASET


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
