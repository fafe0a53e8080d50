"""A small byte-level BPE tokenizer for the embedded corpus, built on first use.

TorchTitan loads tokenizers from the directory ``[model] hf_assets_path`` names
(``tokenizer.json`` plus ``tokenizer_config.json`` for BOS/EOS). No public
tokenizer can be downloaded here, so when that directory has no
``tokenizer.json`` and the job trains on the embedded ``pydoc`` dataset, we train
one on the corpus (about 2 s) and cache it there. Later runs reuse the files.

The vocabulary has 2048 entries, matching the llama3 ``debugmodel`` flavor's
``vocab_size``. Training is single-threaded and deterministic, so every rank
(and every machine) produces byte-identical files.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from torchtitan.tools.logging import logger

from .corpus import CORPUS_PATH, iter_all_texts

VOCAB_SIZE = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


def _atomic_write(path: Path, text: str) -> None:
    # Several ranks may build the tokenizer at once; each writes a private temp
    # file and renames it into place, so a reader never sees a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def train_tokenizer(corpus_path: str | Path = CORPUS_PATH, vocab_size: int = VOCAB_SIZE):
    """Train the byte-level BPE (a ``tokenizers.Tokenizer``) on the whole corpus."""
    # The Rust trainer parallelises by default; one thread makes merges (ties
    # included) reproducible and avoids oversubscribing a 2-core machine.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_all_texts(corpus_path), trainer=trainer)
    return tokenizer


def ensure_tokenizer(assets_dir: str | Path, corpus_path: str | Path = CORPUS_PATH) -> Path:
    """Create ``tokenizer.json`` and ``tokenizer_config.json`` in ``assets_dir`` if missing."""
    assets_dir = Path(assets_dir)
    tokenizer_json = assets_dir / "tokenizer.json"
    if tokenizer_json.exists():
        return assets_dir
    logger.info(f"No tokenizer in {assets_dir}; training a {VOCAB_SIZE}-token BPE on {corpus_path}")
    assets_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_path)
    config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
    }
    _atomic_write(assets_dir / "tokenizer_config.json", json.dumps(config, indent=2))
    _atomic_write(tokenizer_json, tokenizer.to_str())
    return assets_dir
