"""The embedded corpus: Python's own documentation, shipped with the repo.

``data/pydoc_corpus.jsonl.gz`` holds about 1.2 M characters of real English prose
(the Python Language Reference topics and standard-library docstrings; see
``scripts/build_corpus.py`` for provenance and licence). It is read from the
package, never downloaded, so a run gives the same tokens on every machine. Both
TorchTitan lines read it through this module (``titan02/dataset.py`` registers it
for 0.2.x); it imports nothing from TorchTitan.

Every 20th chunk (by id) is held out, so validation text is never trained on and
both splits cover all sources.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

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
