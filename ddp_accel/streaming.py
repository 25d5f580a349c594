"""Sharded data read in place, in one canonical order at any number of processes and workers: WebDataset tar shards
(`000123.jpg` + `000123.cls`, each sample's files side by side under one key), jsonl files (one JSON object a line)
and parquet files (a row a sample).

- The manifest (`manifest.json` beside the shards, written by `ddp-accel shard`, else read from the shards once):
  each shard's name, size, sample count and fingerprint (a tar's: sha256 of its members' names, sizes and places;
  a jsonl file's: of its bytes; a parquet file's: of its footer, which holds every row group's place, size and
  statistics).
- The order of an epoch is a function of (seed, epoch, the manifest) alone: the shards in a permutation drawn from
  (seed, epoch), their samples one after another, then each window of `window` consecutive samples permuted by a
  draw of its own (`WindowShuffle`). A sample's global place in the epoch is its index in that order; the ranks
  and their DataLoader workers take their batches of it as of any map-style dataset (Accelerate's batch sharding),
  so a resume seeks to a place counted in samples, on any number of processes or workers.
- Each worker opens only the shards of its own samples and reads only their bytes (the shard's index: a tar's
  member offsets from its headers, a jsonl file's line offsets, a parquet file's row groups; built the first time
  the worker needs that shard, the last few kept): no process reads the whole stream, and memory does not grow
  with the number of samples.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import tarfile
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from torch.utils.data import Sampler

from ddp_accel.bad_samples import BadSample
from ddp_accel.errors import UserError

MANIFEST = "manifest.json"
SHARD_SUFFIX = ".tar"
WINDOW = 4096  # samples shuffled together in the canonical order (WindowShuffle)


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
    try:
        files = _ustar_files(path)
        if files is None:  # pax or GNU extended headers: the standard library reads them
            with tarfile.open(path, mode="r:") as archive:
                files = [(info.name, info.offset_data, info.size) for info in archive if info.isfile()]
    except (tarfile.TarError, OSError, EOFError, ValueError) as error:
        raise UserError(f"shard {path} cannot be read ({type(error).__name__}: {error}); write it again") from None
    members: list[Member] = []
    for name, offset, size in files:
        key, extension = sample_key(name)
        if not members or members[-1].key != key:
            members.append(Member(key, {}))
        members[-1].files[extension] = (offset, size)
    end = max((offset + size for _, offset, size in files), default=0)
    if end > path.stat().st_size:
        raise UserError(f"shard {path} is truncated (its last sample ends past the file's end); write it again")
    return members


def _ustar_files(path: Path) -> list[tuple[str, int, int]] | None:
    """(name, data offset, size) of each regular file of a tar, read header by header: ustar headers, each
    perhaps after a pax header or a GNU long name (what Python's tarfile and WebDataset's writers write), at a
    third of tarfile's time (a worker indexes each shard it reads, every epoch). None where a rarer header (pax
    global, GNU long link, base-256 sizes) asks for the standard library."""
    files: list[tuple[str, int, int]] = []
    extended: dict[bytes, bytes] = {}  # the next member's pax records (path, size) or GNU long name
    with open(path, "rb") as archive:
        offset = 0
        while True:
            archive.seek(offset)
            header = archive.read(512)
            if len(header) < 512:
                raise EOFError("unexpected end of data")
            if header.count(0) == 512:  # the end-of-archive blocks
                return files
            if int(header[148:156].strip(b"\0 ") or b"0", 8) != sum(header[:148]) + 256 + sum(header[156:]):
                raise tarfile.HeaderError(f"bad checksum at byte {offset}")
            kind = header[156:157]
            if kind in (b"g", b"K") or header[124] & 0x80:
                return None
            size = int(header[124:136].strip(b"\0 ") or b"0", 8)
            if kind in (b"x", b"L"):
                data = archive.read(size)
                extended = _pax_records(data) if kind == b"x" else {b"path": data.split(b"\0", 1)[0]}
            elif kind in (b"0", b"\0", b"7"):
                name = header[:100].split(b"\0", 1)[0]
                if header[257:262] == b"ustar" and header[345] != 0:
                    name = header[345:500].split(b"\0", 1)[0] + b"/" + name
                name, size = extended.get(b"path", name), int(extended.get(b"size", size))
                files.append((name.decode("utf-8", "surrogateescape"), offset + 512, size))
                extended = {}
            offset += 512 + -(-size // 512) * 512


def _pax_records(data: bytes) -> dict[bytes, bytes]:
    """A pax header's records: "LENGTH KEY=VALUE\n" one after another."""
    records, position = {}, 0
    while position < len(data) and data[position] != 0:
        space = data.index(b" ", position)
        length = int(data[position:space])
        key, _, value = data[space + 1 : position + length - 1].partition(b"=")
        records[key] = value
        position += length
    return records


def fingerprint_of(members: Sequence[Member]) -> str:
    digest = hashlib.sha256(repr([(member.key, sorted(member.files.items())) for member in members]).encode())
    return digest.hexdigest()[:24]


class ShardIndex(ABC):
    """Where each sample of one shard is (built from the shard once, by each process that reads it)."""

    suffix = ""

    def __init__(self, path: Path):
        self.path = path

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def fingerprint(self) -> str: ...

    @abstractmethod
    def read(self, local: int) -> tuple[str, dict]:
        """(the sample's key, its record): a tar's files' bytes by extension, a text shard's row by column."""


class TarIndex(ShardIndex):
    suffix = SHARD_SUFFIX

    def __init__(self, path: Path):
        super().__init__(path)
        self.members = read_members(path)

    def __len__(self) -> int:
        return len(self.members)

    def fingerprint(self) -> str:
        return fingerprint_of(self.members)

    def read(self, local: int) -> tuple[str, dict[str, bytes]]:
        member = self.members[local]
        with open(self.path, "rb") as file:
            files = {}
            for extension, (offset, size) in member.files.items():
                file.seek(offset)
                files[extension] = file.read(size)
        return member.key, files


class JsonlIndex(ShardIndex):
    """One JSON object a line; blank lines are skipped. The index: each sample line's byte offset and number."""

    suffix = ".jsonl"

    def __init__(self, path: Path):
        super().__init__(path)
        digest, newlines, size = hashlib.sha256(), [np.zeros(0, np.int64)], 0
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
                newlines.append(np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n")) + size)
                size += len(block)
        ends = np.concatenate(newlines)
        starts, ends = np.concatenate([[0], ends + 1]), np.concatenate([ends, [size]])
        content = ends > starts
        self.starts, self.ends, self.lines = starts[content], ends[content], np.flatnonzero(content) + 1
        self.digest = digest.hexdigest()[:24]

    def __len__(self) -> int:
        return len(self.starts)

    def fingerprint(self) -> str:
        return self.digest

    def read(self, local: int) -> tuple[str, dict]:
        key = f"line {self.lines[local]}"
        with open(self.path, "rb") as file:
            file.seek(self.starts[local])
            line = file.read(int(self.ends[local] - self.starts[local]))
        try:
            row = json.loads(line)
        except ValueError as error:
            raise BadSample(f"shard {self.path}: {key} is not JSON ({error})") from None
        if not isinstance(row, dict):
            raise BadSample(f"shard {self.path}: {key} is not a JSON object ({line[:40]!r})")
        return key, row


class ParquetIndex(ShardIndex):
    """A row a sample; a worker holds the row group it reads (and the one before)."""

    suffix = ".parquet"

    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        super().__init__(path)
        try:
            self.file = pq.ParquetFile(path)
            groups = [self.file.metadata.row_group(group).num_rows for group in range(self.file.num_row_groups)]
        except Exception as error:  # pyarrow's ArrowInvalid, OSError: a file that is not parquet, or cut short
            raise UserError(f"shard {path} cannot be read ({type(error).__name__}: {error}); write it again") from None
        self.starts = np.cumsum([0, *groups]).tolist()
        self.groups: OrderedDict[int, list[dict]] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def fingerprint(self) -> str:
        with open(self.path, "rb") as file:  # the footer: [metadata][its length: 4 bytes]["PAR1"]
            file.seek(-8, 2)
            length = int.from_bytes(file.read(4), "little")
            file.seek(-8 - length, 2)
            return hashlib.sha256(file.read(length)).hexdigest()[:24]

    def read(self, local: int) -> tuple[str, dict]:
        group = bisect.bisect_right(self.starts, local) - 1
        if group not in self.groups:
            self.groups[group] = self.file.read_row_group(group).to_pylist()
            while len(self.groups) > 2:
                self.groups.popitem(last=False)
        return f"row {local + 1}", self.groups[group][local - self.starts[group]]


INDEXES = {index.suffix: index for index in (TarIndex, JsonlIndex, ParquetIndex)}
NOT_IN_PLACE = (".gz", ".zst", ".bz2", ".xz")  # compressed files cannot be read from a sample's offset


def shard_index(path: Path) -> ShardIndex:
    return INDEXES[path.suffix](path)


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
    def of(cls, folder: Path, suffixes: Sequence[str] = (TarIndex.suffix,)) -> ShardManifest:
        """The folder's manifest.json, checked against the shards there (files ending in one of `suffixes`; a shard
        missing, added, or of another size is one line naming it); without one, the shards' own indexes."""
        names = sorted(path.name for path in folder.iterdir() if path.suffix in suffixes and path.is_file())
        if not names:
            compressed = sorted(path.name for path in folder.glob("*") if path.suffix in NOT_IN_PLACE)
            if compressed:
                raise UserError(
                    f"{folder / compressed[0]}: a compressed file cannot be read in place (a sample at a time); "
                    f"write uncompressed {' or '.join(suffixes)} shards (ddp-accel shard)"
                )
            raise UserError(f"{folder} has no {' or '.join(suffixes)} shards")
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
            index = shard_index(folder / name)
            shards.append(Shard(name, (folder / name).stat().st_size, len(index), index.fingerprint()))
        return cls(folder, tuple(shards))

    def subset(self, names: Sequence[str]) -> ShardManifest:
        """These shards only, in the manifest's order (a split held out by whole shards)."""
        kept = set(names)
        return dataclasses.replace(self, shards=tuple(shard for shard in self.shards if shard.name in kept))

    def write(self) -> Path:
        path = self.folder / MANIFEST
        body = {"shards": [asdict(shard) for shard in self.shards], "classes": list(self.classes)}
        path.write_text(json.dumps(body, indent=1) + "\n")
        return path

    def identity(self, prefix: str = "") -> dict[str, str]:
        """Each shard's fingerprint by name (a run's identity: a resume on changed shards is refused naming them)."""
        return {prefix + shard.name: shard.fingerprint for shard in self.shards}

    def fingerprint(self) -> str:
        """The whole manifest's digest (the vocabulary's cache key)."""
        return hashlib.sha256(repr([asdict(shard) for shard in self.shards]).encode()).hexdigest()[:24]


class ShardReader:
    """A sample by its global index (shards in manifest order), read in place; each process (each DataLoader
    worker) indexes what it reads, keeping the indexes of as many shards as a window of the order can span (and
    one more, for the next window's first): in a window, reads jump between its shards at random."""

    def __init__(self, manifest: ShardManifest, window: int = WINDOW):
        self.manifest = manifest
        self.starts = np.cumsum([0, *manifest.counts]).tolist()
        self.keep = shards_spanned(manifest.counts, window) + 1
        self._indexes: OrderedDict[int, ShardIndex] = OrderedDict()

    def __getstate__(self) -> dict:
        # a DataLoader worker builds the indexes of what it reads: none travels in the pickle
        return {**self.__dict__, "_indexes": OrderedDict()}

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, sample within it) of global index `index`."""
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def index(self, shard: int) -> ShardIndex:
        if shard not in self._indexes:
            path = self.manifest.folder / self.manifest.shards[shard].name
            index = shard_index(path)
            if index.fingerprint() != self.manifest.shards[shard].fingerprint:
                raise UserError(f"shard {path} changed since its manifest.json was written")
            self._indexes[shard] = index
            while len(self._indexes) > self.keep:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(shard)
        return self._indexes[shard]

    def read(self, index: int) -> tuple[str, str, dict]:
        """(the shard's path, the sample's key, its record: a tar's files' bytes by extension, a row by column)."""
        shard, local = self.locate(index)
        key, record = self.index(shard).read(local)
        return str(self.manifest.folder / self.manifest.shards[shard].name), key, record


def shards_spanned(counts: Sequence[int], window: int) -> int:
    """The most shards `window` consecutive samples can span, whatever the shards' order: the smallest ones in a
    row, and one partly at each end."""
    total, spanned = 0, 0
    for count in sorted(count for count in counts if count):
        if total + count >= window:
            break
        total, spanned = total + count, spanned + 1
    return min(len(counts), spanned + 2)


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
        for window in self.windows():
            yield from window.tolist()

    def windows(self) -> Iterator[np.ndarray]:
        """The order, a window at a time."""
        stream = (np.arange(self.starts[shard], self.starts[shard + 1]) for shard in self.shard_order())
        for block, window in enumerate(windows(stream, self.window)):
            if self.shuffle:
                window = np.random.default_rng([self.seed, self.epoch, block]).permutation(window)
            yield window


class Place(NamedTuple):
    """A sample's global index and the width its global micro-batch is padded to (LengthBuckets' keys)."""

    sample: int
    width: int


class LengthBuckets(Sampler[Place]):
    """The canonical order (`order`) with little padding: each pool of `pool` global micro-batches of it (`chunk`
    consecutive samples: every process's batch of one forward) sorted by length (ties by index), cut into global
    micro-batches again, and those shuffled by (seed, epoch, pool). Each sample comes with its global micro-batch's
    longest length, which its process pads to: at any number of processes and workers with the same global batch,
    a global micro-batch holds the same samples at the same width, so a run stays bitwise. Memory: one pool (the
    lengths are read from a memory-mapped file)."""

    def __init__(self, order: WindowShuffle, lengths: np.ndarray, chunk: int, pool: int = 50):
        if len(lengths) != len(order):
            raise UserError(f"{len(lengths)} lengths for {len(order)} samples: delete the cache of the shards")
        self.order, self.lengths, self.chunk, self.pool = order, lengths, chunk, pool

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[Place]:
        seed, epoch = self.order.seed, self.order.epoch
        for number, pool in enumerate(windows(self.order.windows(), self.chunk * self.pool)):
            pool = pool[np.lexsort((pool, self.lengths[pool]))]
            chunks = [pool[start : start + self.chunk] for start in range(0, len(pool), self.chunk)]
            full = len(pool) // self.chunk  # a short one only ends the epoch: it stays last
            for chunk in [*np.random.default_rng([seed, epoch, number]).permutation(full).tolist(), full]:
                if chunk < len(chunks):
                    width = int(self.lengths[chunks[chunk][-1]])
                    yield from (Place(index, width) for index in chunks[chunk].tolist())


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
