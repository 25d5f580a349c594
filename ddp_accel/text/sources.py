"""Where reviews come from: a jsonl/csv/parquet file, the aclImdb folder, the Hugging Face hub, or a synthetic
corpus. Each source gives a `datasets.Dataset` of raw `text` and integer `label`; pipeline.py turns it into batches.

Labels everywhere: 1 = positive, 0 = negative (the Hugging Face IMDB convention).
"""

from __future__ import annotations

import functools
import json
import random
import socket
import urllib.parse
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc
from accelerate import Accelerator

from ddp_accel.errors import UserError

_LABEL_NAMES = {"pos": 1, "positive": 1, "1": 1, "neg": 0, "negative": 0, "0": 0}
_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # each also gzipped (.gz)


def _normalise_labels(dataset: datasets.Dataset, source: str) -> datasets.Dataset:
    missing = {"text", "label"} - set(dataset.column_names)
    if missing:
        raise UserError(
            f"{source}: needs columns 'text' and 'label', missing {sorted(missing)} (found {dataset.column_names})"
        )
    if len(dataset) == 0:
        raise UserError(f"{source}: no rows")
    text = dataset.data.table.column("text")
    if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)):
        raise UserError(f"{source}: the 'text' column must hold strings only; some rows hold numbers or other values")
    if text.null_count:
        row = pc.index(pc.is_null(text), True).as_py()
        raise UserError(f"{source}: row {row + 1} has no text (null)")
    labels = dataset.data.table.column("label").to_pylist()
    quoted = [isinstance(label, str) and label.startswith('"') for label in labels]
    if any(quoted):  # a JSON column of numbers and strings: the reader kept every value as its JSON text
        row = quoted.index(not quoted[0])
        raise UserError(
            f"{source}: labels of mixed types: row 1 has {_json_value(labels[0])!r}, row {row + 1} has "
            f"{_json_value(labels[row])!r}; use one kind for every row, 0/1 or pos/neg"
        )
    for row, label in enumerate(labels):
        if not is_label(label):
            bad = sorted({repr(value) for value in labels if not is_label(value)})
            raise UserError(
                f"{source}: row {row + 1} has the label {label!r} ({type(label).__name__}); labels must be 0/1 or "
                f"pos/neg (positive/negative) (found {', '.join(bad[:5])})"
            )
    classes = {label_value(label) for label in labels}
    if len(classes) < 2 and len(labels) > 1:  # (one review: the split says it is too few)
        raise UserError(
            f"{source}: every review is labelled {'positive' if classes == {1} else 'negative'}; a classifier needs "
            "reviews of both classes"
        )

    def to_int(batch: dict[str, list]) -> dict[str, list[int]]:
        return {"label": [label_value(label) for label in batch["label"]]}

    dataset = dataset.map(to_int, batched=True, desc="labels")
    return dataset.cast_column("label", datasets.Value("int64")).select_columns(["text", "label"])


def _json_value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def is_label(value: object) -> bool:
    return isinstance(value, int | str) and not isinstance(value, bool) and str(value).strip().lower() in _LABEL_NAMES


def label_value(value: object) -> int:
    """1 (positive) or 0 (negative) of a label `is_label` accepts."""
    return _LABEL_NAMES[str(value).strip().lower()]


def load_file(path: str | Path) -> datasets.Dataset:
    """A jsonl/json(.gz), csv or parquet file with `text` and `label` columns."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    suffix = Path(path.name.removesuffix(".gz")).suffix  # train.csv.gz is a csv file
    if suffix not in _FORMATS:
        raise UserError(f"{path}: unknown format; use .jsonl, .json, .csv or .parquet (optionally gzipped: .gz)")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: empty file")
    try:
        dataset = datasets.load_dataset(_FORMATS[suffix], data_files=str(path), split="train")
    except Exception as error:
        detail = next((line for line in str(error).splitlines() if "row" in line or "line" in line), "")
        raise UserError(
            f"{path}: cannot be read as {_FORMATS[suffix]} ({type(error).__name__}"
            f"{': ' + detail.strip()[:200] if detail else ''})"
        ) from None
    return _normalise_labels(dataset, str(path))


def load_aclimdb(data_dir: str | Path, split: str) -> datasets.Dataset:
    """The Stanford tarball layout: aclImdb/{train,test}/{pos,neg}/*.txt (`unsup` is ignored)."""
    root = Path(data_dir)
    if (root / "aclImdb").is_dir():
        root = root / "aclImdb"
    folders = [root / split / "pos", root / split / "neg"]
    if not all(folder.is_dir() for folder in folders):
        raise UserError(
            f"--data-dir {data_dir}: expected {split}/pos and {split}/neg folders of .txt reviews "
            "(the aclImdb_v1.tar.gz layout)"
        )
    texts, labels = [], []
    for folder, label in zip(folders, (1, 0), strict=False):
        for file in sorted(folder.glob("*.txt")):
            texts.append(file.read_text(encoding="utf-8", errors="replace"))
            labels.append(label)
    if not texts:
        raise UserError(f"--data-dir {data_dir}: no .txt reviews under {split}/pos and {split}/neg")
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One short TCP connection to the hub (HF_ENDPOINT). False at once when HF_HUB_OFFLINE is set."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
        return True
    except OSError:
        return False


def load_hub_imdb() -> tuple[datasets.Dataset, datasets.Dataset]:
    """The Hugging Face hub dataset (cached after the first download). Without a network, only the local cache
    is read: the hub client would otherwise retry for ~40 s (five 'Retrying in 1s ... 8s' warnings)."""
    if not hub_reachable():
        import huggingface_hub.constants

        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    imdb = datasets.load_dataset("stanfordnlp/imdb")
    return imdb["train"].select_columns(["text", "label"]), imdb["test"].select_columns(["text", "label"])


POSITIVE = [
    "great",
    "excellent",
    "wonderful",
    "loved",
    "brilliant",
    "superb",
    "moving",
    "funny",
    "beautiful",
    "masterpiece",
    "enjoyable",
    "best",
    "charming",
    "perfect",
    "touching",
    "gripping",
]
NEGATIVE = [
    "awful",
    "terrible",
    "boring",
    "waste",
    "worst",
    "dull",
    "poor",
    "stupid",
    "horrible",
    "mess",
    "annoying",
    "weak",
    "pointless",
    "bad",
    "disappointing",
    "lame",
]
NEUTRAL = [
    "the",
    "movie",
    "film",
    "plot",
    "actor",
    "scene",
    "story",
    "was",
    "is",
    "and",
    "a",
    "of",
    "it",
    "director",
    "ending",
    "character",
    "music",
    "i",
    "this",
    "with",
    "script",
    "camera",
    "but",
    "very",
]


@functools.lru_cache(maxsize=4)  # a notebook's or a test session's later runs: the same corpus, drawn once
def synthetic_imdb(size: int = 4000, seed: int = 0) -> datasets.Dataset:
    """A deterministic, learnable sentiment corpus for offline runs and tests (5% label noise). The dataset is
    shared between the calls with the same arguments: like every Dataset, transformed into new ones, never in place."""
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


def load_sources(
    dataset: str, data_dir: str | None, train_file: str | None, test_file: str | None, accelerator: Accelerator
) -> tuple[datasets.Dataset, datasets.Dataset | None, str, bool]:
    if train_file:
        return load_file(train_file), load_file(test_file) if test_file else None, train_file, False
    if test_file:
        raise UserError("--test-file needs --train-file (or use --data-dir)")
    if data_dir:
        test_dir = (
            Path(data_dir) / "aclImdb" / "test" if (Path(data_dir) / "aclImdb").is_dir() else Path(data_dir) / "test"
        )
        test = load_aclimdb(data_dir, "test") if test_dir.is_dir() else None
        return load_aclimdb(data_dir, "train"), test, data_dir, False
    if dataset == "imdb":
        # The main process downloads first, the others then read its cache. The exception is caught
        # inside the block: raising through main_process_first would skip its barrier on one rank only.
        with accelerator.main_process_first():
            try:
                train, test = load_hub_imdb()
                error = None
            except Exception as caught:  # offline, hub down, no cache
                error = caught
        if error is None:
            return train, test, "hub:stanfordnlp/imdb", False
        accelerator.print(
            f"IMDB cannot be reached on the Hugging Face hub ({type(error).__name__}); "
            "pass --data-dir aclImdb/ or --train-file/--test-file for real data. "
            "Training on the built-in SYNTHETIC sentiment corpus instead."
        )
    return synthetic_imdb(4000, seed=0), synthetic_imdb(1000, seed=1), "synthetic", True
