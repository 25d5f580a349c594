"""--skip-bad-samples N: a training sample that cannot be read (an image PIL cannot decode, a sample without its label,
a row that is not JSON or has no text) takes the place of no sample. The next readable sample of the dataset (by
index, wrapping at its end) is read in its place, a `warning:` line names the bad one the first time it is met, and
OUTPUT_DIR/bad_samples.jsonl lists it; a run that meets more than N distinct bad samples ends with the last one's
error, and the end of a run says how many were skipped (metrics.json's `bad_samples`).

The replacement is a function of the data alone, so a run with bad samples is still the same at any number of
processes and DataLoader workers and across a resume. Validation samples are never replaced (a metric over a
stand-in is not the validation set's): a bad one stays an error. Without the option, a bad sample is one error line.
"""

from __future__ import annotations

import json
import sys
from itertools import chain
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from ddp_accel.errors import UserError

LOG = "bad_samples.jsonl"  # in the output folder: one line per bad sample met (by any process, any epoch)


class BadSample(UserError):
    """One sample that cannot be read, named by its file or shard and key. Without --skip-bad-samples: one line."""


class SkippingBadSamples(Dataset):
    """`dataset` with each bad sample replaced by the next readable one. Attributes not its own are the dataset's
    (`set_epoch`, `manifest`)."""

    def __init__(self, dataset: Any, log: Path, limit: int):
        self.dataset, self.log, self.limit = dataset, log, limit

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "dataset" not in self.__dict__:  # a pickle being read: nothing to forward yet
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple) -> Any:
        # a key may carry more than the index (streaming.Place: the width to pad to): the stand-in keeps the rest
        index, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, None)
        size = len(self.dataset)
        for candidate in chain(range(index, size), range(index)):
            try:
                return self.dataset[candidate if rest is None else (candidate, *rest)]
            except BadSample as error:
                self.met(candidate, error)
        raise UserError(f"no sample of the {size} can be read")  # reached only with a limit as large as the set

    def met(self, index: int, error: BadSample) -> None:
        """The first meeting of a bad sample, by any process: said, listed; past the limit, its error ends the run."""
        known = listed(self.log)
        if index in known:
            return
        self.log.parent.mkdir(parents=True, exist_ok=True)  # met before fit made it (imdb.py's NB weights)
        with open(self.log, "a") as file:  # one short line in append mode: processes' lines do not interleave
            file.write(json.dumps({"index": index, "error": str(error)}) + "\n")
        count = len(known) + 1
        if count > self.limit:
            raise beyond_the_limit(error, count, self.limit) from None
        print(
            f"warning: skipped a bad sample ({count} of at most {self.limit}): {error}; the next readable sample "
            f"is read in its place (listed in {self.log})",
            file=sys.stderr,
            flush=True,
        )


def beyond_the_limit(error: BadSample, count: int, limit: int) -> BadSample:
    """The error that ends a run at its `count`-th bad sample, past --skip-bad-samples `limit`."""
    return BadSample(f"{error} (bad sample {count}: more than --skip-bad-samples {limit})")


def listed(log: Path) -> dict[int, str]:
    """The bad samples in a run's log, by index."""
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return {}
    entries = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # a line being written by another process
            continue
        entries[entry["index"]] = entry["error"]
    return entries


def skipping_bad_samples(dataset: Any, output_dir: str | Path, limit: int) -> Any:
    """The training dataset as a run reads it: `dataset` itself without --skip-bad-samples (limit 0)."""
    return SkippingBadSamples(dataset, log_of(output_dir), limit) if limit else dataset


def log_of(output_dir: str | Path) -> Path:
    return Path(output_dir) / LOG


def count(output_dir: str | Path) -> int:
    """The distinct bad samples a run in `output_dir` has skipped (every process's, every epoch's)."""
    return len(listed(log_of(output_dir)))
