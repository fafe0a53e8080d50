"""Specification of the embedded dataset and tokenizer (in-process, no training)."""

from __future__ import annotations

import torch
import pytest

import torchtitan_ext.titan02.job  # noqa: F401  (registers the datasets)
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import ConfigManager
from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader, DATASETS
from torchtitan_ext.corpus import load_split
from torchtitan_ext.titan02.dataset import rewind_validation_before_each_run
from torchtitan_ext.tokenizer import ensure_tokenizer, VOCAB_SIZE

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return ensure_tokenizer(tmp_path_factory.mktemp("tok"))


def test_the_corpus_is_real_english_text():
    text = " ".join(load_split("train"))
    words = text.split()
    assert len(text) > 1_000_000
    for common in ("the", "is", "of", "and", "to"):
        assert words.count(common) > 1000


def test_the_validation_split_is_held_out_and_about_five_percent():
    train, validation = load_split("train"), load_split("validation")
    assert not set(train) & set(validation)
    assert 0.03 < len(validation) / (len(train) + len(validation)) < 0.07


def test_splits_come_back_in_the_same_order_every_time():
    assert load_split("validation") == load_split("validation")


def test_datasets_are_registered_under_torchtitan_dataset_names():
    assert {"pydoc", "pydoc_validation"} <= DATASETS.keys()


def test_the_tokenizer_loads_in_torchtitan_with_bos_eos_and_the_debug_vocab(tokenizer_dir):
    tokenizer = HuggingFaceTokenizer(str(tokenizer_dir))
    assert tokenizer.get_vocab_size() == VOCAB_SIZE == 2048
    ids = tokenizer.encode("The if statement", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == "The if statement"


def test_the_tokenizer_is_built_once_and_then_reused(tokenizer_dir):
    before = (tokenizer_dir / "tokenizer.json").stat().st_mtime_ns
    ensure_tokenizer(tokenizer_dir)
    assert (tokenizer_dir / "tokenizer.json").stat().st_mtime_ns == before


def test_building_the_tokenizer_twice_gives_identical_files(tokenizer_dir, tmp_path):
    ensure_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


def test_every_validation_pass_reads_the_same_held_out_batches(tokenizer_dir):
    job_config = ConfigManager().parse_args([
        "--job.custom_config_module", "torchtitan_ext",
        "--validation.dataset", "pydoc_validation",
        "--validation.seq_len", "64", "--validation.local_batch_size", "2",
    ])
    tokenizer = HuggingFaceTokenizer(str(tokenizer_dir))

    class Validator:  # the part of TorchTitan's Validator the rewind relies on
        def __init__(self):
            self.validation_dataloader = build_text_validation_dataloader(
                dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=job_config, infinite=True)

        def validate(self):
            return next(iter(self.validation_dataloader))[1]

    plain = Validator()
    assert not torch.equal(plain.validate(), plain.validate())  # TorchTitan alone moves on
    rewound = rewind_validation_before_each_run(Validator())
    assert torch.equal(rewound.validate(), rewound.validate())
