"""IMDB-style data: sources (hub, aclImdb folder, jsonl/csv/parquet, synthetic), encoding, length bucketing.

Labels everywhere: 1 = positive, 0 = negative (the Hugging Face IMDB convention).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Iterator

import datasets
from torch.utils.data import Sampler

from ddp_accel.errors import UserError

_LABEL_NAMES = {"pos": 1, "positive": 1, "1": 1, "neg": 0, "negative": 0, "0": 0}
_FORMATS = {".jsonl": "json", ".json": "json", ".gz": "json", ".csv": "csv", ".parquet": "parquet"}


def _normalise_labels(dataset: datasets.Dataset, source: str) -> datasets.Dataset:
    missing = {"text", "label"} - set(dataset.column_names)
    if missing:
        raise UserError(f"{source}: needs columns 'text' and 'label', missing {sorted(missing)} "
                        f"(found {dataset.column_names})")
    if len(dataset) == 0:
        raise UserError(f"{source}: no rows")
    bad = sorted({str(label) for label in dataset.unique("label") if str(label).strip().lower() not in _LABEL_NAMES})
    if bad:
        raise UserError(f"{source}: labels must be 0/1 or pos/neg (positive/negative), found {bad[:5]}")
    to_int = lambda batch: {"label": [_LABEL_NAMES[str(label).strip().lower()] for label in batch["label"]]}
    dataset = dataset.map(to_int, batched=True, desc="labels")
    return dataset.cast_column("label", datasets.Value("int64")).select_columns(["text", "label"])


def load_file(path: str | Path) -> datasets.Dataset:
    """A jsonl/json(.gz), csv or parquet file with `text` and `label` columns."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    suffix = ".jsonl" if path.name.endswith((".jsonl.gz", ".json.gz")) else path.suffix
    if suffix not in _FORMATS:
        raise UserError(f"{path}: unknown format; use .jsonl, .json, .csv or .parquet (optionally .jsonl.gz)")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: empty file")
    try:
        dataset = datasets.load_dataset(_FORMATS[suffix], data_files=str(path), split="train")
    except Exception as error:
        raise UserError(f"{path}: cannot be read as {_FORMATS[suffix]} ({type(error).__name__})") from None
    return _normalise_labels(dataset, str(path))


def load_aclimdb(data_dir: str | Path, split: str) -> datasets.Dataset:
    """The Stanford tarball layout: aclImdb/{train,test}/{pos,neg}/*.txt (`unsup` is ignored)."""
    root = Path(data_dir)
    if (root / "aclImdb").is_dir():
        root = root / "aclImdb"
    folders = [root / split / "pos", root / split / "neg"]
    if not all(folder.is_dir() for folder in folders):
        raise UserError(f"--data-dir {data_dir}: expected {split}/pos and {split}/neg folders of .txt reviews "
                        "(the aclImdb_v1.tar.gz layout)")
    texts, labels = [], []
    for folder, label in zip(folders, (1, 0)):
        for file in sorted(folder.glob("*.txt")):
            texts.append(file.read_text(encoding="utf-8", errors="replace"))
            labels.append(label)
    if not texts:
        raise UserError(f"--data-dir {data_dir}: no .txt reviews under {split}/pos and {split}/neg")
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def load_hub_imdb() -> tuple[datasets.Dataset, datasets.Dataset]:
    """The Hugging Face hub dataset (cached after the first download)."""
    imdb = datasets.load_dataset("stanfordnlp/imdb")
    return imdb["train"].select_columns(["text", "label"]), imdb["test"].select_columns(["text", "label"])


POSITIVE = ["great", "excellent", "wonderful", "loved", "brilliant", "superb", "moving", "funny", "beautiful",
            "masterpiece", "enjoyable", "best", "charming", "perfect", "touching", "gripping"]
NEGATIVE = ["awful", "terrible", "boring", "waste", "worst", "dull", "poor", "stupid", "horrible", "mess",
            "annoying", "weak", "pointless", "bad", "disappointing", "lame"]
NEUTRAL = ["the", "movie", "film", "plot", "actor", "scene", "story", "was", "is", "and", "a", "of", "it",
           "director", "ending", "character", "music", "i", "this", "with", "script", "camera", "but", "very"]


def synthetic_imdb(size: int = 4000, seed: int = 0) -> datasets.Dataset:
    """A deterministic, learnable sentiment corpus for offline runs and tests (5% label noise)."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(size):
        label = rng.randint(0, 1)
        cue, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        words = [rng.choice(NEUTRAL) for _ in range(rng.randint(10, 50))]
        for _ in range(rng.randint(3, 6)):
            words.insert(rng.randrange(len(words)), rng.choice(cue))
        if rng.random() < 0.5:
            words.insert(rng.randrange(len(words)), rng.choice(other))
        sentence = " ".join(words).capitalize() + rng.choice([".", "!", "...", "<br /><br />"])
        texts.append(sentence)
        labels.append(label if rng.random() > 0.05 else 1 - label)
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, default=str, sort_keys=True).encode()).hexdigest()[:16]


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of similar length, so padding stays small; shuffled anew each epoch from (seed, epoch).

    Indices are shuffled, cut into pools of `batch_size * pool_batches`, each pool sorted by length and cut
    into batches, then the batches are shuffled. Every index appears in exactly one batch per epoch.
    Accelerate shards these batches across processes (process i takes batches i, i+N, ...).
    """

    def __init__(self, lengths: list[int], batch_size: int, shuffle: bool = True, seed: int = 0,
                 pool_batches: int = 50):
        self.lengths, self.batch_size, self.shuffle = lengths, batch_size, shuffle
        self.seed, self.pool_batches, self.epoch = seed, pool_batches, 0
        self.drop_last = False

    @property
    def sampler(self):
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
            pool = sorted(indices[start:start + pool_size], key=self.lengths.__getitem__)
            full = len(pool) - len(pool) % size
            batches += [pool[i:i + size] for i in range(0, full, size)]
            leftovers += pool[full:]
        leftovers.sort(key=self.lengths.__getitem__)
        batches += [leftovers[i:i + size] for i in range(0, len(leftovers) - len(leftovers) % size, size)]
        if self.shuffle:
            rng.shuffle(batches)
        # The one short batch goes last: Accelerate's batch sharding assumes only the last batch is short
        # (a short batch mid-epoch makes it drop a whole round of batches).
        short = leftovers[len(leftovers) - len(leftovers) % size:]
        return iter(batches + ([short] if short else []))
