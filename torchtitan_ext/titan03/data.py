"""The embedded corpus and its tokenizer as TorchTitan 0.3 components (no download).

* ``PydocDataLoader``: TorchTitan's ``HuggingFaceTextDataLoader`` reading the embedded
  Python-docs corpus (``torchtitan_ext.corpus``): ``dataset="pydoc"`` for training,
  ``"pydoc_validation"`` (the held-out chunks) for ``Validator.Config(dataloader=...)``.
* ``PydocTokenizer``: TorchTitan's ``HuggingFaceTokenizer`` that first makes sure
  ``hf_assets_path`` holds the 2048-token BPE trained on that corpus
  (``torchtitan_ext.tokenizer.ensure_tokenizer``; trained and cached on first use).

Why subclasses: 0.3 builds both from their ``Config`` at job start, so registering the
corpus in TorchTitan's ``DATASETS`` table (its documented extension point) and training
the tokenizer happen when, and only when, a job uses them; importing this module changes
nothing. 0.3's validator rebuilds its dataloader for every pass, so every pass scores the
same held-out batches without the rewind the 0.2.x adapter needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from ..corpus import TRAIN_DATASET, VALIDATION_DATASET
from ..tokenizer import ensure_tokenizer

# The 0.2.x adapter's registration works unchanged on 0.3 (same DATASETS table and
# DatasetConfig); see the report to the lead about moving it into the shared core.
from ..datasets import register_datasets

__all__ = ["PydocDataLoader", "PydocTokenizer", "TRAIN_DATASET", "VALIDATION_DATASET"]


class PydocDataLoader(HuggingFaceTextDataLoader):
    """``HuggingFaceTextDataLoader`` over the embedded corpus (train split by default)."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        dataset: str = TRAIN_DATASET
        """``"pydoc"`` (training split) or ``"pydoc_validation"`` (held-out split)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        register_datasets()  # idempotent: (re)writes the two DATASETS entries
        super().__init__(config, **kwargs)


class PydocTokenizer(HuggingFaceTokenizer):
    """``HuggingFaceTokenizer`` that trains the corpus BPE into ``tokenizer_path`` if missing."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str, **kwargs: Any) -> None:
        ensure_tokenizer(tokenizer_path)
        super().__init__(config, tokenizer_path=tokenizer_path, **kwargs)
