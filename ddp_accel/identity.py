"""A run's identity: the options and inputs that shape its model, data pipeline and data, and the library versions.

Recorded in every checkpoint (TrainState.identity) and in the committed args.json; a resume (or an IMDB `--predict`)
under another identity stops with one line naming what differs. Not identity: the world size, the batch size, the
workers, the launcher, the output path, and options that only change the schedule (lr, epochs, max-steps, logging).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from ddp_accel.errors import UserError

VERSIONS = ("torch", "accelerate", "ddp-accel")


def versions() -> dict[str, str]:
    found = {}
    for package in VERSIONS:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "unknown"
    return found


def source_fingerprint(source: str | Path | None) -> str | None:
    """A single file by its content (sha256), a folder by the sorted list of (path, size, mtime) of everything in it,
    anything else (a hub dataset name) as it is."""
    if source is None:
        return None
    path = Path(source)
    if path.is_file():
        return f"file sha256:{file_sha256(path)[:24]}"
    if path.is_dir():
        digest = hashlib.sha256()
        for entry in sorted(_walk(path)):
            digest.update(repr(entry).encode())
        return f"folder {digest.hexdigest()[:24]}"
    return str(source)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's content, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _walk(root: Path) -> Iterable[tuple[str, int, int]]:
    """(relative path, size, mtime) of every file under `root`; a folder seen twice (a link loop) is walked once."""
    seen: set[tuple[int, int]] = set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        stat = os.stat(folder)
        if (stat.st_dev, stat.st_ino) in seen:
            subfolders[:] = []
            continue
        seen.add((stat.st_dev, stat.st_ino))
        for name in files:
            path = Path(folder, name)
            try:
                info = path.stat()
            except OSError:  # a dangling link
                continue
            yield str(path.relative_to(root)), info.st_size, info.st_mtime_ns


def make_identity(options: dict[str, Any], sources: dict[str, str | Path | None] | None = None) -> dict[str, Any]:
    """`options`: the values that shape the model and the data pipeline; `sources`: the data, fingerprinted."""
    identity: dict[str, Any] = {key: _plain(value) for key, value in sorted(options.items())}
    for key, source in sorted((sources or {}).items()):
        identity[key] = source_fingerprint(source)
    return {"options": identity, "versions": versions()}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def compare_identity(saved: dict[str, Any] | None, current: dict[str, Any], what: str) -> str | None:
    """None when `saved` matches `current`; else raises UserError naming what differs. Returns a warning for what
    does not stop a resume: other library versions, or an identity that was not recorded (older checkpoints)."""
    if not saved:
        return f"{what} was written before run identities were recorded; its options and data cannot be checked"
    differences = [
        f"{_option(key)} was {saved['options'].get(key)!r}, now {value!r}"
        for key, value in current["options"].items()
        if key in saved.get("options", {}) and saved["options"][key] != value
    ]
    differences += [
        f"{_option(key)} was {value!r}, now not given"
        for key, value in saved.get("options", {}).items()
        if key not in current["options"]
    ]
    if differences:
        raise UserError(
            f"{what} was made with other options or data: "
            + "; ".join(differences)
            + ". Use the same options and data, or another --output-dir"
        )
    old, new = saved.get("versions", {}), current["versions"]
    changed = [f"{name} {old[name]} -> {new[name]}" for name in new if old.get(name) not in (None, new[name])]
    if changed:
        return (
            f"{what} was written with other versions ({', '.join(changed)}): bitwise resume holds within one "
            "version set"
        )
    return None


def _option(key: str) -> str:
    return key if " " in key else "--" + key.replace("_", "-")
