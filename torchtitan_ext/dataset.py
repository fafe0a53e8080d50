"""The embedded default dataset: Python's own documentation, shipped with the repo.

``data/pydoc_corpus.jsonl.gz`` holds about 1.2 M characters of real English prose
(the Python Language Reference topics and standard-library docstrings; see
``scripts/build_corpus.py`` for provenance and licence). It is read from the
package, never downloaded, so a run gives the same tokens on every machine.

Two TorchTitan dataset names are registered (in TorchTitan's own ``DATASETS``
table, the documented extension point of ``torchtitan.hf_datasets.text_datasets``):

* ``pydoc``            -> ``[training] dataset``: the training split,
* ``pydoc_validation`` -> ``[validation] dataset``: the held-out split.

Every 20th chunk (by id) is held out, so validation text is never trained on and
both splits cover all sources.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.tools.logging import logger

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "pydoc_corpus.jsonl.gz"
TRAIN_DATASET = "pydoc"
VALIDATION_DATASET = "pydoc_validation"
HOLD_OUT_EVERY = 20  # chunk ids 0, 20, 40, ... form the validation split


@lru_cache(maxsize=None)
def _read_records(path: str) -> tuple[dict[str, Any], ...]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f)


def load_split(split: str, path: str | Path = CORPUS_PATH) -> list[str]:
    """Texts of one split ("train" or "validation"), in a fixed order."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    held_out = split == "validation"
    return [
        r["text"]
        for r in _read_records(str(path))
        if (r["id"] % HOLD_OUT_EVERY == 0) == held_out
    ]


def iter_all_texts(path: str | Path = CORPUS_PATH) -> Iterator[str]:
    """Every chunk of the corpus, both splits (what the tokenizer is trained on)."""
    for r in _read_records(str(path)):
        yield r["text"]


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
