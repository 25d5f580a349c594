"""From raw reviews to padded, length-bucketed batches: preprocess once (cached), not per batch."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader, Sampler

from ddp_accel.errors import UserError
from ddp_accel.files import replaced_atomically, write_text, writing
from ddp_accel.identity import fingerprint_sources, shards_identity
from ddp_accel.streaming import ShardManifest
from ddp_accel.text import sources
from ddp_accel.text.streamed import StreamedReviews, count_tokens, held_out_shards, is_text_shards, text_manifest
from ddp_accel.text.tokenizer import basic_english
from ddp_accel.text.vocab import Vocab

PIPELINE_VERSION = "basic_english-1/int32-ids"


@dataclass
class TextData:
    train: datasets.Dataset | StreamedReviews  # StreamedReviews: a folder of shards, read in place
    val: datasets.Dataset | StreamedReviews | None  # None with --val-fraction 0: every review trains
    test: datasets.Dataset | StreamedReviews | None
    vocab: Vocab
    source: str
    synthetic: bool
    truncated: int  # training reviews longer than max_length
    preprocess_s: float
    vocab_path: Path  # in the cache: fit copies it into the output dir with the model
    sources: dict[str, Any]  # fingerprints of the training and test data (ddp_accel.identity)


def default_cache_dir() -> Path:
    """Encoded data is cached per user, not in the output dir: a command that fails leaves the output dir as it was."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddp_accel" / "imdb"


def check_cache_dir(cache: Path) -> None:
    """The encoded-data cache is a folder this process can write (said before any data is read)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"the encoded-data cache {cache} is a file, or inside one; give --cache-dir a folder") from None
    except PermissionError:
        raise UserError(
            f"the encoded-data cache {cache} cannot be created; give --cache-dir a writable folder"
        ) from None
    if not os.access(cache, os.W_OK | os.X_OK):
        raise UserError(f"the encoded-data cache {cache} is not writable; give --cache-dir a writable folder")


def _fold_split(
    reviews: datasets.Dataset, fold: str, seed: int, source: str, group_size: int = 1
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training part and the held-out I-th of K parts ("I/K") of `reviews`: runs of `group_size` consecutive
    reviews in the order of a shuffle by `seed` (review by review with 1)."""
    index, count = (int(part) for part in fold.split("/"))
    groups = -(-len(reviews) // group_size)
    if groups < count:
        raise UserError(
            f"{source}: {len(reviews)} review(s) in runs of --group-size {group_size} cannot be split into {count} "
            "folds; give more reviews" + (" or a smaller --group-size" if group_size > 1 else "")
        )
    order = np.random.default_rng(seed).permutation(groups)
    start, end = (index - 1) * groups // count, index * groups // count
    return _split_runs(reviews, group_size, order[start:end])


def _group_split(
    reviews: datasets.Dataset, fraction: float, seed: int, source: str, group_size: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training part and a held-out `fraction` of `reviews`, in whole runs of `group_size` consecutive reviews."""
    groups = -(-len(reviews) // group_size)
    take = round(fraction * groups)
    if not 0 < take < groups:
        raise UserError(
            f"{source}: {len(reviews)} review(s) in runs of --group-size {group_size} cannot be split into training "
            f"and validation parts with --val-fraction {fraction}; give more reviews or a smaller --group-size"
        )
    return _split_runs(reviews, group_size, np.random.default_rng(seed).permutation(groups)[:take])


def _split_runs(
    reviews: datasets.Dataset, group_size: int, held_runs: np.ndarray
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The reviews outside and inside `held_runs` (indices of runs of `group_size` consecutive reviews)."""
    held = np.isin(np.arange(len(reviews)) // group_size, held_runs)
    return reviews.select(np.flatnonzero(~held)), reviews.select(np.flatnonzero(held))


@dataclass(frozen=True)
class TextSource:
    """Where the reviews come from: `dataset` ("imdb" from the hub, "synthetic"), or an aclImdb folder, or files
    (jsonl/csv/parquet with text and label columns; a test file is evaluated at the end)."""

    dataset: str = "imdb"
    data_dir: str | None = None
    train_file: str | None = None
    test_file: str | None = None


@dataclass(frozen=True)
class TextOptions:
    """How the training reviews are split, and how all of them are encoded (each an imdb.py option)."""

    val_fraction: float = 0.1
    fold: str | None = None  # "I/K": the I-th of K parts held out instead of val_fraction
    group_size: int = 1  # hold out whole runs of this many consecutive reviews
    min_freq: int = 20
    max_vocab: int | None = None
    max_length: int | None = None
    seed: int = 0
    cache_dir: str | None = None
    skip_bad_samples: int = 0  # --skip-bad-samples: the vocabulary's pass skips as many bad training reviews


def prepare_text_data(accelerator: Accelerator, source: TextSource, options: TextOptions) -> TextData:
    """Load, split, tokenise, build the vocabulary (main process first) and encode, with an on-disk cache.

    The second run with the same inputs reads the encoded arrow files instead of tokenising again. `fold` "I/K":
    the held-out part is the I-th of K equal parts of the training reviews shuffled by `seed` (k-fold
    cross-validation: K runs, each review held out once), instead of a random `val_fraction`. `group_size` N > 1:
    both hold out whole runs of N consecutive reviews (the official IMDB split lists each movie's reviews
    together, and a movie on both sides of a split overstates the held-out accuracy).
    """
    if is_text_shards(source.train_file):
        return prepare_streamed_text(accelerator, source, options)
    start = time.perf_counter()
    cache = Path(options.cache_dir) if options.cache_dir else default_cache_dir()
    check_cache_dir(cache)
    train, test, name, synthetic = sources.load_sources(
        source.dataset, source.data_dir, source.train_file, source.test_file, accelerator
    )
    # a --data-dir has test/
    data_paths = {"train data": source.train_file or source.data_dir or name, "test data": source.test_file}
    fingerprints = fingerprint_sources(data_paths, accelerator=accelerator)
    train, val, held_out = _hold_out(train, options, name)
    # the datasets version too: a cache file written by one version can fail to load in another
    key = cache_key(
        fingerprints["train data"], len(train), held_out, options.seed, PIPELINE_VERSION, datasets.__version__
    )
    num_proc = min(4, os.cpu_count() or 1) if len(train) > 5000 else None
    encoding = _Encoding(cache, key, num_proc, options.max_length, fingerprints["test data"])
    vocab_path = cache / f"vocab-{cache_key(key, options.min_freq, options.max_vocab)}.json"
    with accelerator.main_process_first():
        tokens = encoding.tokenized(train, "tokenize", f"train-{key}")
        if accelerator.is_main_process:
            try:  # cached with the encoded data it indexes
                Vocab.load(vocab_path)
            except (OSError, ValueError, KeyError, TypeError):  # missing, or damaged: built again
                Vocab.from_counts(_token_counts(tokens), options.min_freq, options.max_vocab).save(vocab_path)
    vocab = Vocab.load(vocab_path)
    if len(vocab) <= 2:  # every rank raises: the vocabulary is read by all of them
        raise UserError(
            f"the vocabulary is empty: no token occurs at least --min-freq {options.min_freq} times in the "
            f"{len(train)} training reviews; lower --min-freq"
        )
    with accelerator.main_process_first():
        train_ids = encoding.encoded(train, "train", vocab, tokenized=tokens)
        val_ids = encoding.encoded(val, "val", vocab) if val is not None else None
        test_ids = encoding.encoded(test, "test", vocab) if test is not None else None
    full_lengths = train_ids.data.table.column("full_length").to_numpy()
    truncated = int((full_lengths > options.max_length).sum()) if options.max_length else 0
    return TextData(
        train_ids,
        val_ids,
        test_ids,
        vocab,
        name,
        synthetic,
        truncated,
        time.perf_counter() - start,
        vocab_path,
        fingerprints,
    )


def prepare_streamed_text(accelerator: Accelerator, source: TextSource, options: TextOptions) -> TextData:
    """A folder of jsonl/parquet shards (`source.train_file`), read in place (ddp_accel.text.streamed): validation
    holds out whole shards; the vocabulary is one pass over the training shards, cached by their manifest."""
    start = time.perf_counter()
    if options.group_size > 1:
        raise UserError(
            f"--group-size {options.group_size} holds out runs of reviews of one file; shards are held out whole: "
            "drop --group-size"
        )
    cache = Path(options.cache_dir) if options.cache_dir else default_cache_dir()
    check_cache_dir(cache)
    shards = text_manifest(str(source.train_file))
    held = held_out_shards(shards, options.val_fraction, options.fold, options.seed)
    train = shards.subset([shard.name for shard in shards.shards if shard.name not in held])
    val = shards.subset(held) if held else None
    test = text_manifest(source.test_file) if source.test_file else None
    held_out = (options.fold or options.val_fraction, sorted(held))
    key = cache_key(train.fingerprint(), held_out, options.min_freq, options.max_vocab, options.max_length)
    vocab_path = cache / f"vocab-shards-{cache_key(key, PIPELINE_VERSION, 'lengths')}.json"
    _vocabulary_pass(accelerator, train, options, vocab_path)
    cached = _cached_vocab(vocab_path)
    if cached is None:  # written by the main process just before: unreadable here is a broken cache folder
        raise UserError(f"the vocabulary {vocab_path} cannot be read; delete it, or give another --cache-dir")
    vocab, truncated = cached
    if len(vocab) <= 2:
        raise UserError(
            f"the vocabulary is empty: no token occurs at least --min-freq {options.min_freq} times in the "
            f"{len(train)} training reviews; lower --min-freq"
        )
    fingerprints = {  # the manifests': each shard's content fingerprint
        "train data": shards_identity(shards.identity()),
        "test data": shards_identity(test.identity()) if test else None,
    }
    return TextData(
        StreamedReviews(train, vocab, options.max_length, _cached_lengths(_lengths_path(vocab_path), len(train))),
        StreamedReviews(val, vocab, options.max_length) if val else None,
        StreamedReviews(test, vocab, options.max_length) if test else None,
        vocab,
        str(source.train_file),
        False,
        truncated,
        time.perf_counter() - start,
        vocab_path,
        fingerprints,
    )


def _vocabulary_pass(accelerator: Accelerator, train: ShardManifest, options: TextOptions, vocab_path: Path) -> None:
    """The vocabulary and each review's length, counted by the main process once (cached by the shards' manifest).
    A bad shard met by the pass is raised on every rank: through main_process_first, only rank 0 would leave it,
    and the others would wait at its barrier until they lost contact."""
    problem = None
    with accelerator.main_process_first():
        if accelerator.is_main_process and _cached_vocab(vocab_path) is None:
            try:
                counts, truncated, lengths = count_tokens(
                    train, options.max_length, show=True, skip=options.skip_bad_samples
                )
            except UserError as error:
                problem = str(error)
            else:  # the lengths first: a vocabulary in the cache has them
                path = _lengths_path(vocab_path)
                with writing(path), replaced_atomically(path) as partial, open(partial, "wb") as file:
                    np.save(file, lengths)
                tokens = Vocab.from_counts(counts, options.min_freq, options.max_vocab).itos
                write_text(vocab_path, json.dumps({"tokens": tokens, "truncated": truncated}, ensure_ascii=False))
    if accelerator.num_processes > 1:
        problem = broadcast_object_list([problem])[0]
    if problem:
        raise UserError(problem)


def _lengths_path(vocab_path: Path) -> Path:
    return vocab_path.with_suffix(".lengths.npy")


def _cached_lengths(path: Path, samples: int) -> np.ndarray | None:
    """Each training review's length in tokens, memory-mapped (bucketing reads a pool at a time); None where the
    cache lacks them (the reviews are then batched in the canonical order as they come)."""
    try:
        lengths = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None
    return lengths if lengths.shape == (samples,) else None


def _cached_vocab(path: Path) -> tuple[Vocab, int] | None:
    """The vocabulary and truncated-review count of a cache file; None where it is missing or damaged."""
    try:
        saved = json.loads(path.read_text())
        return Vocab(saved["tokens"]), int(saved["truncated"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _hold_out(
    train: datasets.Dataset, options: TextOptions, source: str
) -> tuple[datasets.Dataset, datasets.Dataset | None, Any]:
    """The training part, the held-out part (None: --val-fraction 0), and what was held out (a part of the encoded
    data's cache key)."""
    fold, group_size, seed = options.fold, options.group_size, options.seed
    if fold is None and options.val_fraction == 0:  # a final model: every review trains
        return train, None, 0.0
    if fold is not None:
        train, val = _fold_split(train, fold, seed, source, group_size)
        return train, val, f"fold {fold}" + (f" in runs of {group_size}" if group_size > 1 else "")
    if group_size > 1:
        train, val = _group_split(train, options.val_fraction, seed, source, group_size)
        return train, val, f"{options.val_fraction} in runs of {group_size}"
    try:
        split = train.train_test_split(test_size=options.val_fraction, seed=seed, stratify_by_column=None)
    except ValueError:  # too few reviews for a held-out part
        raise UserError(
            f"{source}: {len(train)} review(s) cannot be split into training and validation parts "
            f"with --val-fraction {options.val_fraction}; give more reviews"
        ) from None
    return split["train"], split["test"], options.val_fraction


def _tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[str]]]:
    return {"tokens": [basic_english(text) for text in batch["text"]]}


@dataclass(frozen=True)
class _Encoding:
    """Tokenising and encoding the splits of one run into the cache: the files are named by a key of everything
    they depend on (`key`: the training data, its split, the seed, the pipeline version)."""

    cache: Path
    key: str
    num_proc: int | None
    max_length: int | None
    test_fingerprint: str | dict | None  # train and val: in `key`

    def tokenized(self, reviews: datasets.Dataset, desc: str, file_key: str) -> datasets.Dataset:
        return cached_map(
            reviews,
            _tokenize,
            batched=True,
            num_proc=self.num_proc,
            remove_columns=["text"],
            desc=desc,
            cache_file_name=str(self.cache / f"{file_key}-tokens.arrow"),
        )

    def encoded(
        self, reviews: datasets.Dataset, name: str, vocab: Vocab, tokenized: datasets.Dataset | None = None
    ) -> datasets.Dataset:
        """`reviews` as token ids (`tokenized`: their tokens, when already made)."""
        source_key = self.test_fingerprint if name == "test" else None
        split_key = cache_key(self.key, name, source_key, vocab.itos, self.max_length)
        if tokenized is None:
            tokenized = self.tokenized(reviews, f"tokenize {name}", f"{name}-{split_key}")
        return cached_map(
            tokenized.with_format("arrow"),
            _encoder(vocab, self.max_length),
            batched=True,
            batch_size=5000,
            remove_columns=["tokens"],
            desc=f"encode {name}",
            cache_file_name=str(self.cache / f"{name}-{split_key}-ids.arrow"),
        ).with_format(None)


def _encoder(vocab: Vocab, max_length: int | None) -> Any:
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
        return pa.table(
            {
                "input_ids": input_ids,
                "label": batch.column("label"),  # an arrow result replaces the row
                "length": pc.list_value_length(input_ids),
                "full_length": full_length,
            }
        )

    return encode


def cached_map(dataset: datasets.Dataset, function: Any, *, cache_file_name: str, **options: Any) -> datasets.Dataset:
    """`dataset.map` into a cache file, read back when it exists. A damaged cache file (cut short by a full disk or
    a killed run) is deleted and built again once; a file-system failure while building it is one line."""
    path = Path(cache_file_name)
    for attempt in (1, 2):
        try:
            with writing(path, cleanup=None):
                mapped = dataset.map(function, cache_file_name=cache_file_name, **options)
                len(mapped.data)  # the arrow file is read here, if it was cached
                return mapped
        except (OSError, ValueError, pa.ArrowException) as error:
            files = cache_files(path)
            if attempt == 2 or not files:
                raise
            print(f"warning: the cache file {path} is damaged ({type(error).__name__}); building it again", flush=True)
            for file in files:
                file.unlink(missing_ok=True)
    raise AssertionError("unreachable")


def cache_files(path: Path) -> list[Path]:
    """A map's cache file, and the shards a multi-process map writes instead (NAME_00001_of_00002.arrow)."""
    shards = path.parent.glob(f"{glob.escape(path.stem)}_[0-9]*_of_[0-9]*{path.suffix}")
    return [file for file in [path, *sorted(shards)] if file.is_file()]


def _token_counts(tokenized: datasets.Dataset) -> dict[str, int]:
    """How often each token occurs, counted by Arrow (value_counts) instead of a Python Counter."""
    counts = pc.value_counts(pc.list_flatten(tokenized.data.table.column("tokens")))
    return dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=False))


class EncodedReviews(torch.utils.data.Dataset):
    """Reads token ids straight from the arrow files' buffers (memory-mapped): no Python lists per
    sample, and DataLoader workers share the pages instead of each holding a copy of the corpus (a worker started by
    a forkserver receives the dataset pickled: the Arrow files by path, and it maps them itself)."""

    def __init__(self, encoded: datasets.Dataset):
        if encoded._indices is not None:  # a select()/shuffle() view: write it out once
            encoded = encoded.flatten_indices()
        self._map(encoded)

    def __getstate__(self) -> dict[str, Any]:
        return {"encoded": self.encoded}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._map(state["encoded"])

    def _map(self, encoded: datasets.Dataset) -> None:
        self.encoded = encoded
        table = encoded.data.table
        chunks = table.column("input_ids").chunks
        self.offsets = [chunk.offsets.to_numpy() for chunk in chunks]
        self.values = [chunk.values.to_numpy() for chunk in chunks]
        self.chunk_starts = np.cumsum([0] + [len(chunk) for chunk in chunks])
        self.labels = table.column("label").to_numpy()
        self.lengths = table.column("length").to_pylist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        chunk = int(np.searchsorted(self.chunk_starts, index, side="right")) - 1
        offsets, row = self.offsets[chunk], index - self.chunk_starts[chunk]
        return self.values[chunk][offsets[row] : offsets[row + 1]], int(self.labels[index])

    def __getitems__(self, indices: list[int]) -> list[tuple[np.ndarray, int]]:
        return [self[index] for index in indices]


class PadCollate:
    """Pad to the longest review of the batch (at least `min_length`); ids as int64, labels as int64."""

    def __init__(self, pad_id: int, min_length: int = 1):
        self.pad_id, self.min_length = pad_id, min_length

    def __call__(self, samples: list[tuple[np.ndarray, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(self.min_length, max(len(ids) for ids, _ in samples))
        input_ids = np.full((len(samples), width), self.pad_id, dtype=np.int64)
        for row, (ids, _) in enumerate(samples):
            input_ids[row, : len(ids)] = ids
        labels = torch.tensor([label for _, label in samples], dtype=torch.long)
        return torch.from_numpy(input_ids), labels


def make_loader(
    encoded: datasets.Dataset | StreamedReviews,
    batch_size: int,
    collate: PadCollate,
    *,
    shuffle: bool,
    seed: int,
    workers: int = 0,
    read_through: Callable[[Any], Any] | None = None,
) -> DataLoader:
    """`read_through`: what wraps the reviews (the training set's Run.skipping_bad_samples)."""
    reviews: StreamedReviews | EncodedReviews
    if isinstance(encoded, StreamedReviews):  # in the shards' canonical order (ddp_accel.streaming)
        reviews = encoded
        together = batch_size * PartialState().num_processes  # a global micro-batch: what LengthBuckets sorts as one
        batching: dict[str, Any] = {"batch_size": batch_size, "sampler": encoded.sampler(shuffle, seed, together)}
    else:
        reviews = EncodedReviews(encoded)
        batching = {"batch_sampler": BucketBatchSampler(reviews.lengths, batch_size, shuffle=shuffle, seed=seed)}
    return DataLoader(
        read_through(reviews) if read_through else reviews,
        **batching,
        collate_fn=collate,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def cache_key(*parts: Any) -> str:
    """A short hash of everything an encoded cache file depends on."""
    return hashlib.sha256(json.dumps(parts, default=str, sort_keys=True).encode()).hexdigest()[:16]


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of similar length, so padding stays small; shuffled anew each epoch from (seed, epoch).

    Indices are shuffled, cut into pools of `batch_size * pool_batches`, each pool sorted by length and cut
    into batches, then the batches are shuffled. Every index appears in exactly one batch per epoch.
    Accelerate shards these batches across processes (process i takes batches i, i+N, ...).
    """

    def __init__(
        self, lengths: list[int], batch_size: int, shuffle: bool = True, seed: int = 0, pool_batches: int = 50
    ):
        self.lengths, self.batch_size, self.shuffle = lengths, batch_size, shuffle
        self.seed, self.pool_batches, self.epoch = seed, pool_batches, 0
        self.drop_last = False

    @property
    def sampler(self) -> BucketBatchSampler:
        # Accelerate's DataLoaderShard.set_epoch reaches a sharded batch sampler's epoch through `.sampler`
        return self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (len(self.lengths) + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(range(len(self.lengths)))
        rng = random.Random(self.seed * 100_003 + self.epoch)
        if self.shuffle:
            rng.shuffle(indices)
        pool_size, size = self.batch_size * self.pool_batches, self.batch_size
        batches, leftovers = [], []
        for start in range(0, len(indices), pool_size):
            pool = sorted(indices[start : start + pool_size], key=self.lengths.__getitem__)
            full = len(pool) - len(pool) % size
            batches += [pool[i : i + size] for i in range(0, full, size)]
            leftovers += pool[full:]
        leftovers.sort(key=self.lengths.__getitem__)
        batches += [leftovers[i : i + size] for i in range(0, len(leftovers) - len(leftovers) % size, size)]
        if self.shuffle:
            rng.shuffle(batches)
        # The one short batch goes last: Accelerate's batch sharding assumes only the last batch is short
        # (a short batch mid-epoch makes it drop a whole round of batches).
        short = leftovers[len(leftovers) - len(leftovers) % size :]
        return iter(batches + ([short] if short else []))
