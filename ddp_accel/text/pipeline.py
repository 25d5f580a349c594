"""From raw reviews to padded, length-bucketed batches: preprocess once (cached), not per batch."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from ddp_accel.errors import UserError
from ddp_accel.text import data
from ddp_accel.text.tokenizer import basic_english
from ddp_accel.text.vocab import Vocab

PIPELINE_VERSION = "basic_english-1/int32-ids"


@dataclass
class TextData:
    train: datasets.Dataset
    val: datasets.Dataset
    test: datasets.Dataset | None
    vocab: Vocab
    source: str
    synthetic: bool
    truncated: int  # training reviews longer than max_length
    preprocess_s: float


def load_sources(dataset: str, data_dir: str | None, train_file: str | None, test_file: str | None,
                 accelerator: Accelerator) -> tuple[datasets.Dataset, datasets.Dataset | None, str, bool]:
    if train_file:
        return data.load_file(train_file), data.load_file(test_file) if test_file else None, train_file, False
    if test_file:
        raise UserError("--test-file needs --train-file (or use --data-dir)")
    if data_dir:
        test_dir = Path(data_dir) / "aclImdb" / "test" if (Path(data_dir) / "aclImdb").is_dir() else Path(data_dir) / "test"
        test = data.load_aclimdb(data_dir, "test") if test_dir.is_dir() else None
        return data.load_aclimdb(data_dir, "train"), test, data_dir, False
    if dataset == "imdb":
        # The main process downloads first, the others then read its cache. The exception is caught
        # inside the block: raising through main_process_first would skip its barrier on one rank only.
        with accelerator.main_process_first():
            try:
                train, test = data.load_hub_imdb()
                error = None
            except Exception as caught:  # offline, hub down, no cache
                error = caught
        if error is None:
            return train, test, "hub:stanfordnlp/imdb", False
        accelerator.print(f"IMDB cannot be reached on the Hugging Face hub ({type(error).__name__}); "
                          "pass --data-dir aclImdb/ or --train-file/--test-file for real data. "
                          "Training on the built-in SYNTHETIC sentiment corpus instead.")
    return data.synthetic_imdb(4000, seed=0), data.synthetic_imdb(1000, seed=1), "synthetic", True


def _source_key(source: str) -> list:
    path = Path(source)
    return [source, path.stat().st_size, path.stat().st_mtime_ns] if path.is_file() else [source]


def prepare_text_data(accelerator: Accelerator, *, output_dir: str, dataset: str = "imdb", data_dir: str | None = None,
                      train_file: str | None = None, test_file: str | None = None, val_fraction: float = 0.1,
                      min_freq: int = 20, max_vocab: int | None = None, max_length: int | None = None,
                      seed: int = 0, cache_dir: str | None = None) -> TextData:
    """Load, split, tokenise, build the vocabulary (main process first) and encode, with an on-disk cache.

    The second run with the same inputs reads the encoded arrow files instead of tokenising again.
    """
    start = time.perf_counter()
    train, test, source, synthetic = load_sources(dataset, data_dir, train_file, test_file, accelerator)
    split = train.train_test_split(test_size=val_fraction, seed=seed, stratify_by_column=None)
    train, val = split["train"], split["test"]
    cache = Path(cache_dir or Path(output_dir) / "cache")
    key = data.fingerprint(_source_key(source), len(train), val_fraction, seed, PIPELINE_VERSION)
    num_proc = min(4, os.cpu_count() or 1) if len(train) > 5000 else None

    def tokenize(batch):
        return {"tokens": [basic_english(text) for text in batch["text"]]}

    vocab_path = Path(output_dir) / "vocab.json"
    with accelerator.main_process_first():
        cache.mkdir(parents=True, exist_ok=True)
        tokens = train.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"], desc="tokenize",
                           cache_file_name=str(cache / f"train-{key}-tokens.arrow"))
        if accelerator.is_main_process:
            vocab = Vocab.from_counts(_token_counts(tokens), min_freq, max_vocab)
            vocab_path.parent.mkdir(parents=True, exist_ok=True)
            vocab.save(vocab_path)
    vocab = Vocab.load(vocab_path)
    vocab_tokens = pa.array(vocab.itos)

    def encode(batch: pa.Table) -> pa.Table:
        """Token lists -> id lists in Arrow's C++ kernels (index_in), not a Python dict lookup per token."""
        tokens = batch.column("tokens").combine_chunks()
        ids = pc.fill_null(pc.index_in(pc.list_flatten(tokens), value_set=vocab_tokens), Vocab.unk_id)
        full_length = pc.list_value_length(tokens)
        offsets = pa.array(np.concatenate([[0], np.cumsum(full_length.to_numpy())]), pa.int32())
        input_ids = pa.ListArray.from_arrays(offsets, ids)
        if max_length:
            input_ids = pc.list_slice(input_ids, 0, max_length)
        return pa.table({"input_ids": input_ids, "label": batch.column("label"),  # an arrow result replaces the row
                         "length": pc.list_value_length(input_ids), "full_length": full_length})

    def encode_split(split_data: datasets.Dataset, name: str) -> datasets.Dataset:
        split_key = data.fingerprint(key, name, vocab.itos[:50], len(vocab), max_length)
        tokenized = tokens if name == "train" else split_data.map(
            tokenize, batched=True, num_proc=num_proc, remove_columns=["text"], desc=f"tokenize {name}",
            cache_file_name=str(cache / f"{name}-{split_key}-tokens.arrow"))
        return tokenized.with_format("arrow").map(
            encode, batched=True, batch_size=5000, remove_columns=["tokens"], desc=f"encode {name}",
            cache_file_name=str(cache / f"{name}-{split_key}-ids.arrow")).with_format(None)

    with accelerator.main_process_first():
        train_ids, val_ids = encode_split(train, "train"), encode_split(val, "val")
        test_ids = encode_split(test, "test") if test is not None else None
    full_lengths = train_ids.data.table.column("full_length").to_numpy()
    truncated = int((full_lengths > max_length).sum()) if max_length else 0
    return TextData(train_ids, val_ids, test_ids, vocab, source, synthetic, truncated, time.perf_counter() - start)


def _token_counts(tokenized: datasets.Dataset) -> dict[str, int]:
    """How often each token occurs, counted by Arrow (value_counts) instead of a Python Counter."""
    counts = pc.value_counts(pc.list_flatten(tokenized.data.table.column("tokens")))
    return dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))


class EncodedReviews(torch.utils.data.Dataset):
    """Reads token ids straight from the arrow files' buffers (memory-mapped): no Python lists per
    sample, and DataLoader workers share the pages instead of each holding a copy of the corpus."""

    def __init__(self, encoded: datasets.Dataset):
        if encoded._indices is not None:  # a select()/shuffle() view: write it out once
            encoded = encoded.flatten_indices()
        table = encoded.data.table
        chunks = table.column("input_ids").chunks
        self.offsets = [chunk.offsets.to_numpy() for chunk in chunks]
        self.values = [chunk.values.to_numpy() for chunk in chunks]
        self.chunk_starts = np.cumsum([0] + [len(chunk) for chunk in chunks])
        self.labels = table.column("label").to_numpy()
        self.lengths = table.column("length").to_pylist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        chunk = int(np.searchsorted(self.chunk_starts, index, side="right")) - 1
        offsets, row = self.offsets[chunk], index - self.chunk_starts[chunk]
        return self.values[chunk][offsets[row]:offsets[row + 1]], int(self.labels[index])

    def __getitems__(self, indices: list[int]):
        return [self[index] for index in indices]


class PadCollate:
    """Pad to the longest review of the batch (at least `min_length`); ids as int64, labels as int64."""

    def __init__(self, pad_id: int, min_length: int = 1):
        self.pad_id, self.min_length = pad_id, min_length

    def __call__(self, samples):
        width = max(self.min_length, max(len(ids) for ids, _ in samples))
        input_ids = np.full((len(samples), width), self.pad_id, dtype=np.int64)
        for row, (ids, _) in enumerate(samples):
            input_ids[row, :len(ids)] = ids
        labels = torch.tensor([label for _, label in samples], dtype=torch.long)
        return torch.from_numpy(input_ids), labels


def make_loader(encoded: datasets.Dataset, batch_size: int, pad_id: int, *, shuffle: bool, seed: int,
                min_length: int = 1, workers: int = 0) -> DataLoader:
    reviews = EncodedReviews(encoded)
    batches = data.BucketBatchSampler(reviews.lengths, batch_size, shuffle=shuffle, seed=seed)
    return DataLoader(reviews, batch_sampler=batches, collate_fn=PadCollate(pad_id, min_length),
                      num_workers=workers, persistent_workers=workers > 0)
