"""Sharded data read in place (WebDataset tar shards: `000123.jpg` + `000123.cls`, each sample's files side by side
under one key), in one canonical order at any number of processes and workers.

- The manifest (`manifest.json` beside the shards, written by `ddp-accel shard`, else read from the shards once):
  each shard's name, size, sample count and fingerprint (sha256 of its members' names, sizes and places).
- The order of an epoch is a function of (seed, epoch, the manifest) alone: the shards in a permutation drawn from
  (seed, epoch), their samples one after another, then each window of `window` consecutive samples permuted by a
  draw of its own (`WindowShuffle`). A sample's global place in the epoch is its index in that order; the ranks
  and their DataLoader workers take their batches of it as of any map-style dataset (Accelerate's batch sharding),
  so a resume seeks to a place counted in samples, on any number of processes or workers.
- Each worker opens only the shards of its own samples and reads only their bytes (the shard's index of
  member offsets, built from its tar headers the first time the worker needs it; the last few kept): no process
  reads the whole stream, and memory does not grow with the number of samples.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import tarfile
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import Sampler

from ddp_accel.errors import UserError

MANIFEST = "manifest.json"
SHARD_SUFFIX = ".tar"
OPEN_INDEXES = 4  # shard indexes a worker keeps: a window spans one or two shards


@dataclass(frozen=True)
class Shard:
    name: str  # relative to the shards' folder
    size: int
    samples: int
    fingerprint: str


@dataclass(frozen=True)
class Member:
    """One sample of a shard: its key and, by extension (`jpg`, `cls`), each file's (offset, size) in the tar."""

    key: str
    files: dict[str, tuple[int, int]]


def sample_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member name, as WebDataset splits it: the key runs to the first dot of the base name."""
    folder, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension.lower() if dot else ""


def read_members(path: Path) -> list[Member]:
    """The samples of a tar shard in their order, from its headers (the data is not read). A truncated or
    unreadable shard is one line naming it."""
    members: list[Member] = []
    try:
        with tarfile.open(path, mode="r:") as archive:
            for info in archive:
                if not info.isfile():
                    continue
                key, extension = sample_key(info.name)
                if not members or members[-1].key != key:
                    members.append(Member(key, {}))
                members[-1].files[extension] = (info.offset_data, info.size)
    except (tarfile.TarError, OSError, EOFError) as error:
        raise UserError(f"shard {path} cannot be read ({type(error).__name__}: {error}); write it again") from None
    end = max((offset + size for member in members for offset, size in member.files.values()), default=0)
    if end > path.stat().st_size:
        raise UserError(f"shard {path} is truncated (its last sample ends past the file's end); write it again")
    return members


def fingerprint_of(members: Sequence[Member]) -> str:
    digest = hashlib.sha256(repr([(member.key, sorted(member.files.items())) for member in members]).encode())
    return digest.hexdigest()[:24]


@dataclass(frozen=True)
class ShardManifest:
    folder: Path
    shards: tuple[Shard, ...]
    classes: tuple[str, ...] = ()  # the class names of a classification set, when the writer knew them

    @property
    def counts(self) -> list[int]:
        return [shard.samples for shard in self.shards]

    def __len__(self) -> int:
        return sum(self.counts)

    @classmethod
    def of(cls, folder: Path) -> ShardManifest:
        """The folder's manifest.json, checked against the shards there (a shard missing, added, or of another
        size is one line naming it); without one, the shards' own headers."""
        names = sorted(path.relative_to(folder).as_posix() for path in folder.glob(f"*{SHARD_SUFFIX}"))
        if not names:
            raise UserError(f"{folder} has no {SHARD_SUFFIX} shards")
        written = folder / MANIFEST
        if not written.is_file():
            return cls.scanned(folder, names)
        data = json.loads(written.read_text())
        manifest = cls(folder, tuple(Shard(**shard) for shard in data["shards"]), tuple(data.get("classes", ())))
        listed = [shard.name for shard in manifest.shards]
        for name in sorted(set(listed) ^ set(names)):
            where = "is missing from the folder" if name in listed else "is not in its manifest.json"
            raise UserError(f"shard {folder / name} {where}; write the shards again (ddp-accel shard)")
        for shard in manifest.shards:
            if (folder / shard.name).stat().st_size != shard.size:
                raise UserError(f"shard {folder / shard.name} changed since its manifest.json was written")
        return manifest

    @classmethod
    def scanned(cls, folder: Path, names: Sequence[str]) -> ShardManifest:
        shards = []
        for name in names:
            members = read_members(folder / name)
            shards.append(Shard(name, (folder / name).stat().st_size, len(members), fingerprint_of(members)))
        return cls(folder, tuple(shards))

    def write(self) -> Path:
        path = self.folder / MANIFEST
        body = {"shards": [asdict(shard) for shard in self.shards], "classes": list(self.classes)}
        path.write_text(json.dumps(body, indent=1) + "\n")
        return path

    def fingerprint(self) -> str:
        """The whole manifest's digest: a run's identity (a resume on other shards is refused)."""
        return hashlib.sha256(repr([asdict(shard) for shard in self.shards]).encode()).hexdigest()[:24]


class ShardReader:
    """A sample's files by its global index (shards in manifest order), read in place; each process (each
    DataLoader worker) opens what it reads, the last OPEN_INDEXES shard indexes kept."""

    def __init__(self, manifest: ShardManifest):
        self.manifest = manifest
        self.starts = np.cumsum([0, *manifest.counts]).tolist()
        self._indexes: OrderedDict[int, list[Member]] = OrderedDict()

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, sample within it) of global index `index`."""
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def members(self, shard: int) -> list[Member]:
        if shard not in self._indexes:
            path = self.manifest.folder / self.manifest.shards[shard].name
            members = read_members(path)
            if fingerprint_of(members) != self.manifest.shards[shard].fingerprint:
                raise UserError(f"shard {path} changed since its manifest.json was written")
            self._indexes[shard] = members
            while len(self._indexes) > OPEN_INDEXES:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(shard)
        return self._indexes[shard]

    def read(self, index: int) -> tuple[str, str, dict[str, bytes]]:
        """(the shard's path, the sample's key, its files' bytes by extension)."""
        shard, local = self.locate(index)
        member = self.members(shard)[local]
        path = self.manifest.folder / self.manifest.shards[shard].name
        with open(path, "rb") as file:
            files = {}
            for extension, (offset, size) in member.files.items():
                file.seek(offset)
                files[extension] = file.read(size)
        return str(path), member.key, files


class WindowShuffle(Sampler[int]):
    """The global indices of an epoch in the canonical order (module docstring): a function of (seed, epoch, the
    shards' sample counts). `shuffle=False` keeps the manifest's order (evaluation). Memory: one window."""

    def __init__(self, counts: Sequence[int], seed: int, window: int, shuffle: bool = True):
        self.counts, self.seed, self.window, self.shuffle = list(counts), seed, max(1, window), shuffle
        self.starts = np.cumsum([0, *self.counts])
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Accelerate's prepared loader calls this at each epoch's start."""
        self.epoch = epoch

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.counts))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.counts))

    def __iter__(self) -> Iterator[int]:
        order = self.shard_order()
        stream = (np.arange(self.starts[shard], self.starts[shard + 1]) for shard in order)
        for block, window in enumerate(windows(stream, self.window)):
            if self.shuffle:
                window = np.random.default_rng([self.seed, self.epoch, block]).permutation(window)
            yield from window.tolist()


def windows(stream: Iterator[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The concatenation of `stream`'s arrays in consecutive pieces of `size` (the last one shorter)."""
    pending: list[np.ndarray] = []
    held = 0
    for part in stream:
        pending.append(part)
        held += len(part)
        while held >= size:
            joined = np.concatenate(pending)
            yield joined[:size]
            pending, held = [joined[size:]], held - size
    if held:
        yield np.concatenate(pending)
