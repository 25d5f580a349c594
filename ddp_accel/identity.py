"""A run's identity: the options and inputs that shape its model, data pipeline and data (by content), and the
library versions.

Recorded in every checkpoint (RunIdentity) and in the committed args.json; a resume (or an IMDB `--predict`)
under another identity stops with one line naming what differs. Not identity: the world size, the batch size, the
workers, the launcher, the output path, and options that only change the schedule (lr, epochs, max-steps, logging).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ddp_accel.errors import UserError

VERSIONS = ("torch", "accelerate", "numpy", "ddp-accel")


def versions() -> dict[str, str]:
    return dict(_installed_versions())


@functools.cache  # the versions this process imported: an upgrade after the first read does not change them
def _installed_versions() -> dict[str, str]:
    found = {}
    for package in VERSIONS:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "unknown"
    return found


CONTENT_LIMIT = 512 * 1024**2  # a folder up to this size is fingerprinted by content, a larger one by its listing


def source_fingerprint(
    source: str | Path | dict | None, exclude: Iterable[str | Path] = (), content_limit: int = CONTENT_LIMIT
) -> str | dict | None:
    """A single file by its content (sha256). A folder by every file's relative path and size, and by content: all
    of it up to `content_limit` bytes, above that one file in k, every k-th in path order, so that about
    `content_limit` bytes are read whatever the size (hashing ImageNet's 150 GB at every start would take minutes).
    Each top-level part (`train`, `val`) gets its own digest and counts, so a refusal shows which part changed.
    Never by modification times: the same data copied again (a requeued job staging it to node-local scratch) is the
    same data. Hidden files and folders and the `exclude` folders (a run's own output dir inside the data) are left
    out. Anything else (a hub dataset name) as it is."""
    if source is None or isinstance(source, dict):  # None, or shards by their manifest (`shards_identity`)
        return source
    path = Path(source)
    if path.is_file():
        return f"file sha256:{file_sha256(path)[:24]}"
    if not path.is_dir():
        return str(source)
    files = sorted(_walk(path, {Path(folder).resolve() for folder in exclude}))
    every = max(1, math.ceil(sum(size for _, size in files) / content_limit))
    parts: dict[str, list[tuple[str, int, str | None]]] = {}
    for index, (name, size) in enumerate(files):
        content = file_sha256(path / name) if index % every == 0 else None
        parts.setdefault(name.split(os.sep, 1)[0] if os.sep in name else ".", []).append((name, size, content))
    whole = hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()[:24]
    described = "; ".join(
        f"{part}: {len(entries)} files, {sum(size for _, size, _ in entries):,} bytes, "
        f"{hashlib.sha256(repr(entries).encode()).hexdigest()[:8]}"
        for part, entries in sorted(parts.items())
    )
    how = "content" if every == 1 else f"paths, sizes and the content of 1 file in {every}"
    return f"folder sha256:{whole} (by {how}; {described})"


def file_sha256(path: Path) -> str:
    """The sha256 of a file's content, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _walk(root: Path, skipped: set[Path]) -> Iterable[tuple[str, int]]:
    """(relative path, size) of every file under `root`, hidden entries and `skipped` folders left out; a folder
    seen twice (a link loop) is walked once."""
    seen: set[tuple[int, int]] = set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        stat = os.stat(folder)
        if (stat.st_dev, stat.st_ino) in seen or Path(folder).resolve() in skipped:
            subfolders[:] = []
            continue
        seen.add((stat.st_dev, stat.st_ino))
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        for name in files:
            path = Path(folder, name)
            if name.startswith("."):
                continue
            try:
                info = path.stat()
            except OSError:  # a dangling link
                continue
            yield str(path.relative_to(root)), info.st_size


def make_identity(
    options: dict[str, Any],
    sources: Mapping[str, str | Path | None] | None = None,
    exclude: Iterable[str | Path] = (),
    accelerator: Any = None,
    unset: Mapping[str, Any] | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """`options`: the values that shape the model and the data pipeline; `sources`: the data, fingerprinted by
    `fingerprint_sources` (`exclude`: folders inside them that are not data, such as the run's output dir).
    `unset`: options recorded only when they differ from the value given here (options added after runs were
    saved without them, which then resume): a saved identity that lacks one had it at that value, so turning it on
    at a resume is a change like any other. `labels`: how a refusal names a value that no single option sets (the
    options that decide it), instead of `--key`."""
    unset = {key: _plain(value) for key, value in (unset or {}).items()}
    identity: dict[str, Any] = {
        key: _plain(value) for key, value in sorted(options.items()) if key not in unset or _plain(value) != unset[key]
    }
    identity.update(fingerprint_sources(sources or {}, exclude, accelerator))
    extra = {**({"unset": unset} if unset else {}), **({"labels": dict(labels)} if labels else {})}
    return {"options": identity, "versions": versions(), **extra}


def fingerprint_sources(
    sources: Mapping[str, str | Path | dict | None], exclude: Iterable[str | Path] = (), accelerator: Any = None
) -> dict[str, str | dict | None]:
    """Each source's `source_fingerprint`. With `accelerator`, the main process fingerprints and the others receive
    its fingerprints: a large folder is walked once per job, not once per rank (ImageNet: about 16 s,
    benchmarks/fingerprint.py)."""
    fingerprints: dict[str, str | dict | None] | None = None
    if accelerator is None or accelerator.is_main_process:
        fingerprints = {key: source_fingerprint(source, exclude) for key, source in sorted(sources.items())}
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        fingerprints = broadcast_object_list([fingerprints])[0]
    return fingerprints or {}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def compare_identity(
    saved: dict[str, Any] | None,
    current: dict[str, Any],
    what: str,
    remedy: str = "Use the same options and data, or another --output-dir",
) -> str | None:
    """None when `saved` matches `current`; else raises UserError naming what differs, then `remedy`. Returns a
    warning for what does not stop a resume: other library versions, or an identity that was not recorded (older
    checkpoints)."""
    if not saved:
        return f"{what} was written before run identities were recorded; its options and data cannot be checked"
    older = [key for key, value in saved.get("options", {}).items() if _mtime_fingerprint(value)]
    if older:  # folders an earlier version fingerprinted by modification times: not comparable with content
        saved = {**saved, "options": {k: v for k, v in saved["options"].items() if k not in older}}
    labels = current.get("labels", {})
    differences = [
        _difference(_option(key, labels), saved["options"][key], value)
        for key, value in current["options"].items()
        if key in saved.get("options", {}) and saved["options"][key] != value
    ]
    unset = current.get("unset", {})
    differences += [
        f"{_option(key, labels)} was {value!r}, now " + (f"{unset[key]!r}" if key in unset else "not given")
        for key, value in saved.get("options", {}).items()
        if key not in current["options"]
    ]
    differences += [
        f"{_option(key, labels)} was not given ({unset[key]!r}), now {value!r}"
        for key, value in current["options"].items()
        if key in unset and key not in saved.get("options", {})
    ]
    if differences:
        changed_data = any(
            _is_fingerprint(saved["options"].get(key))
            for key, value in current["options"].items()
            if key in saved["options"] and saved["options"][key] != value
        )
        raise UserError(
            f"{what} was made with other options or data: "
            + "; ".join(differences)
            + f". {remedy}"
            + (
                " (to go on knowingly with the changed data, start that new run from the weights trained so far: "
                "the checkpoint's model.safetensors)"
                if changed_data
                else ""
            )
        )
    return _identity_warnings(saved, current, what, older)


def _identity_warnings(saved: dict[str, Any], current: dict[str, Any], what: str, older: list[str]) -> str | None:
    """What does not stop a resume, in one line: data fingerprinted by modification times (`older`, not compared)
    and other library versions."""
    old, new = saved.get("versions", {}), current["versions"]
    changed = [f"{name} {old[name]} -> {new[name]}" for name in new if old.get(name) not in (None, new[name])]
    warnings = []
    if older:
        warnings.append(
            f"{what} fingerprinted {', '.join(_option(key) for key in older)} by modification times (an earlier "
            "version); that data is not compared"
        )
    if changed:
        warnings.append(
            f"{what} was written with other versions ({', '.join(changed)}): bitwise resume holds within one "
            "version set"
        )
    return "; ".join(warnings) or None


def _is_fingerprint(value: Any) -> bool:
    """A data source's fingerprint (not an option's value)."""
    return isinstance(value, str) and value.startswith(("folder ", "file sha256:")) or _is_shards(value)


def _is_shards(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("shards"), dict)


def shards_identity(fingerprints: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Shards by their manifest (name -> content fingerprint): a refused resume names the shards that changed."""
    return {"shards": dict(sorted(fingerprints.items()))}


def _difference(option: str, saved: Any, current: Any) -> str:
    if not (_is_shards(saved) and _is_shards(current)):
        return f"{option} was {saved!r}, now {current!r}"
    old, new = saved["shards"], current["shards"]
    changes = [f"shard {name} changed" for name in old if name in new and old[name] != new[name]]
    changes += [f"shard {name} is gone" for name in old if name not in new]
    changes += [f"shard {name} is new" for name in new if name not in old]
    more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    return f"{option}: {', '.join(changes[:3])}{more} since the checkpoint"


def _mtime_fingerprint(value: Any) -> bool:
    """A folder fingerprint of an earlier version: 'folder ' and 24 hex digits (paths, sizes and mtimes)."""
    return isinstance(value, str) and re.fullmatch(r"folder [0-9a-f]{24}", value) is not None


def _option(key: str, labels: Mapping[str, str] | None = None) -> str:
    if labels and key in labels:
        return labels[key]
    return key if " " in key else "--" + key.replace("_", "-")


def model_fingerprint(model: torch.nn.Module) -> str:
    """Class name + hash of parameter names and shapes: tells a checkpoint of another model apart."""
    shapes = [(name, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    return f"{type(model).__name__}:{digest}"


# parameter-group options that decide what state the optimizer keeps (SGD's momentum buffers, Adam's max_exp_avg_sq,
# RMSprop's grad_avg): a checkpoint's state does not fit an optimizer without them. lr, betas, weight decay and the
# like only change the schedule and may change at a resume.
STATE_SHAPING_OPTIONS = ("momentum", "amsgrad", "centered")


def optimizer_fingerprint(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's type, its groups' sizes and the options that shape its state, e.g.
    `AdamW(4 params, amsgrad off)`; several (ddp_accel.Optimizers) joined with ' + '."""
    parts = []
    for inner in getattr(optimizer, "optimizers", None) or [optimizer]:
        groups = [
            ", ".join(
                [f"{len(group['params'])} params"]
                + [f"{key} {'on' if group[key] else 'off'}" for key in STATE_SHAPING_OPTIONS if key in group]
            )
            for group in inner.param_groups
        ]
        parts.append(f"{type(inner).__name__}({'; '.join(groups)})")
    return " + ".join(parts)
