"""Reviews as shards read in place (ddp_accel.streaming): a folder of jsonl or parquet files, each row a review
with `text` and `label`. Nothing is held in memory or encoded ahead: a DataLoader worker reads, tokenises and
encodes the reviews of its own batches, in the canonical order of (seed, epoch, the shards' manifest), so a resume
seeks on any number of processes or workers. The vocabulary is counted in one pass over the training shards
(main process first; cached). `write_text_shards` writes shards from one file (`ddp-accel shard text`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ddp_accel.bad_samples import BadSample, beyond_the_limit
from ddp_accel.errors import UserError
from ddp_accel.streaming import (
    WINDOW,
    JsonlIndex,
    LengthBuckets,
    ParquetIndex,
    ShardManifest,
    ShardReader,
    WindowShuffle,
)
from ddp_accel.text.sources import is_label, label_value
from ddp_accel.text.tokenizer import basic_english
from ddp_accel.text.vocab import Vocab

TEXT_SUFFIXES = (JsonlIndex.suffix, ParquetIndex.suffix)


def is_text_shards(path: str | Path | None) -> bool:
    """A folder (of jsonl/parquet shards), rather than one file: read in place."""
    return path is not None and Path(path).is_dir()


def text_manifest(path: str | Path) -> ShardManifest:
    """A folder's shards, or one jsonl/parquet file as a manifest of one shard (a test file beside streamed
    training data)."""
    path = Path(path)
    if path.is_dir():
        return ShardManifest.of(path, TEXT_SUFFIXES)
    if path.suffix not in TEXT_SUFFIXES:
        raise UserError(f"{path}: beside streamed training shards, a file is read in place as .jsonl or .parquet")
    return ShardManifest.scanned(path.parent, [path.name])


def review_of(path: str, key: str, row: dict) -> tuple[str, int]:
    """(text, label 1/0) of a row; one line naming the shard and the row where one is missing or unreadable."""
    if not isinstance(row.get("text"), str):
        what = "no text" if row.get("text") is None else f"a text of type {type(row['text']).__name__}"
        raise BadSample(f"shard {path}: {key} has {what}; each row needs 'text' (a string) and 'label'")
    label = row.get("label")
    if not is_label(label):
        raise BadSample(f"shard {path}: {key} has the label {label!r}; labels must be 0/1 or pos/neg")
    return row["text"], label_value(label)


class StreamedReviews(torch.utils.data.Dataset):
    """A split's reviews by global index: (token ids as int32, label), as `pipeline.EncodedReviews` gives them."""

    def __init__(
        self, manifest: ShardManifest, vocab: Vocab, max_length: int | None, lengths: np.ndarray | None = None
    ):
        self.manifest, self.vocab, self.max_length = manifest, vocab, max_length
        self.lengths = lengths  # each review's token count (the vocabulary's pass): a shuffled order bucketed by it
        self.reader = ShardReader(manifest)

    def __len__(self) -> int:
        return len(self.manifest)

    def sampler(
        self, shuffle: bool, seed: int, global_micro_batch: int, window: int = WINDOW
    ) -> WindowShuffle | LengthBuckets:
        """The canonical order; shuffled, with each global micro-batch's reviews of similar length (LengthBuckets)
        where their lengths are known."""
        order = WindowShuffle(self.manifest.counts, seed, window, shuffle)
        if not shuffle or self.lengths is None:
            return order
        return LengthBuckets(order, self.lengths, global_micro_batch)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[np.ndarray, int]:
        """A review by its global index, or by its Place (index, width: padded to its global micro-batch's)."""
        index, width = key if isinstance(key, tuple) else (key, 0)
        text, label = review_of(*self.reader.read(index))
        ids = self.vocab.encode(basic_english(text)[: self.max_length])
        padded = np.full(max(width, len(ids)), self.vocab.pad_id, dtype=np.int32)
        padded[: len(ids)] = ids
        return padded, label


def count_tokens(
    manifest: ShardManifest, max_length: int | None, show: bool, skip: int = 0
) -> tuple[Counter[str], int, np.ndarray]:
    """Each token's count over the shards, in one pass (memory: the vocabulary), how many reviews are longer than
    `max_length`, and each review's length in tokens (at most `max_length`; 0 for a bad one). Up to `skip` bad
    reviews are left out (--skip-bad-samples: training says each)."""
    counts: Counter[str] = Counter()
    truncated, bad = 0, 0
    lengths = np.zeros(len(manifest), np.int32)
    reader = ShardReader(manifest)
    for index in tqdm(range(len(manifest)), desc="vocabulary", unit="review", disable=not show, mininterval=1):
        try:
            text = review_of(*reader.read(index))[0]
        except BadSample as error:
            bad += 1
            if bad > skip:
                raise (beyond_the_limit(error, bad, skip) if skip else error) from None
            continue
        tokens = basic_english(text)
        counts.update(tokens)
        truncated += bool(max_length and len(tokens) > max_length)
        lengths[index] = min(len(tokens), max_length or len(tokens))
    return counts, truncated, lengths


def held_out_shards(manifest: ShardManifest, fraction: float, fold: str | None, seed: int) -> list[str]:
    """The shards held out for validation: `fold` "I/K", the I-th of K parts of the shards shuffled by `seed`,
    else round(fraction x shards) of them. Whole shards: a review's place in the stream needs no list."""
    names = [shard.name for shard in manifest.shards]
    order = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]
    if fold is not None:
        index, count = (int(part) for part in fold.split("/"))
        if len(names) < count:
            raise UserError(
                f"{manifest.folder}: {len(names)} shard(s) cannot be split into {count} folds (streamed data is held "
                "out by whole shards); write more, smaller shards (ddp-accel shard text --samples-per-shard)"
            )
        return order[(index - 1) * len(names) // count : index * len(names) // count]
    if fraction == 0:
        return []
    take = max(1, round(fraction * len(names)))  # at least one shard
    if take >= len(names):
        raise UserError(
            f"{manifest.folder}: --val-fraction {fraction} of {len(names)} shard(s) holds out all of them (streamed "
            "data is held out by whole shards, at least one); write more, "
            "smaller shards (ddp-accel shard text --samples-per-shard) or give --val-fraction 0 and a --test-file"
        )
    return order[:take]


def write_text_shards(
    source: str | Path, output: str | Path, samples_per_shard: int = 10_000, seed: int = 0, kind: str = "jsonl"
) -> Path:
    """One jsonl/csv/parquet file's reviews as shards under `output` (000000.jsonl or .parquet, ...) with their
    manifest.json: `text` and `label` (1/0) a row, in a random order drawn from `seed` (a file often lists the
    reviews class by class, and a run shuffles within a window of neighbours)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ddp_accel.text.sources import load_file

    reviews = load_file(source)
    order = np.random.default_rng(seed).permutation(len(reviews))
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with tqdm(total=len(reviews), desc=f"shards of {out.name}", unit="review") as progress:
        for number, first in enumerate(range(0, len(reviews), samples_per_shard)):
            part = reviews.select(order[first : first + samples_per_shard])[:]
            name = f"{number:06d}.{kind}"
            if kind == "parquet":
                pq.write_table(pa.table(part), out / name, row_group_size=1000)
            else:
                rows = zip(part["text"], part["label"], strict=True)
                lines = (json.dumps({"text": text, "label": label}, ensure_ascii=False) + "\n" for text, label in rows)
                (out / name).write_text("".join(lines), encoding="utf-8")
            names.append(name)
            progress.update(len(part["label"]))
    return ShardManifest.scanned(out, names).write()
