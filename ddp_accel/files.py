"""Files written whole or not at all: written aside, then renamed into place (a crash leaves the old file)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `path`; once the block wrote it, it replaces `path` in one rename. The
    temporary name holds the process id: two processes writing one file never share a half-written one."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    with replaced_atomically(path) as partial:
        partial.write_text(text)


def finite_or_null(value: Any) -> Any:
    """NaN and infinities become None (JSON null): json.dumps would write NaN, which is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def write_json(path: str | Path, value: Any, indent: int = 2) -> None:
    write_text(path, json.dumps(finite_or_null(value), indent=indent, default=str, allow_nan=False))


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextlib.contextmanager
def writing(path: str | Path, cleanup: Path | None = None) -> Iterator[None]:
    """A write into `path` that fails for a reason of the file system (full, read-only, not permitted) becomes one
    line naming the path, whatever library raised it (torch says 'unexpected pos', safetensors 'I/O error'); the
    half-written `cleanup` (a file or folder) is removed first, so a full disk is not left full."""
    path = Path(path)
    try:
        yield
    except Exception as error:
        reason = None
        try:
            full = shutil.disk_usage(_existing(path)).free < 1 << 20
        except OSError:
            full = False
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) or full:
            reason = "no space left on its device"
        elif isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            reason = error.strerror
        if cleanup is not None:
            if cleanup.is_dir():
                shutil.rmtree(cleanup, ignore_errors=True)
            else:
                cleanup.unlink(missing_ok=True)
        if reason is None:
            raise
        from ddp_accel.errors import UserError

        raise UserError(f"cannot write {path}: {reason}; free space or pick another --output-dir") from None
