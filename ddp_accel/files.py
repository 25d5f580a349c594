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
    """`text` into `path`, whole or not at all; a file system that cannot take it is one line (`writing`)."""
    with writing(path), replaced_atomically(path) as partial:
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


def is_error(error: BaseException) -> bool:
    """An Exception, or torch.distributed.checkpoint's CheckpointException (a BaseException that gathers the
    ranks' failures of a sharded save or load)."""
    return isinstance(error, Exception) or type(error).__name__ == "CheckpointException"


NO_SPACE = "no space left on its device"
# what libraries that wrap the OSError say instead (safetensors: "I/O error: No space left on device (os error 28)")
_REASONS = {
    errno.ENOSPC: NO_SPACE,
    errno.EDQUOT: NO_SPACE,
    errno.EROFS: os.strerror(errno.EROFS),
    errno.EACCES: os.strerror(errno.EACCES),
    errno.EPERM: os.strerror(errno.EPERM),
}


def file_system_reason(error: BaseException) -> str | None:
    """Why `error` is the file system's (full, read-only, not permitted), looked for in the error, what it was
    raised from, the failures torch.distributed.checkpoint gathers from its ranks, and what a wrapping library's
    message says; None for any other error."""
    seen: set[int] = set()
    pending: list[Any] = [error]
    while pending:
        found = pending.pop()
        if not isinstance(found, BaseException) or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, OSError) and found.errno in _REASONS:
            return _REASONS[found.errno]
        for code, reason in _REASONS.items():
            if os.strerror(code) in str(found):
                return reason
        if "unexpected pos" in str(found):  # torch.save's zip writer, after a short write: the disk took no more
            return NO_SPACE
        failures = getattr(found, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):  # rank -> (the exception, its traceback)
            pending += [item[0] if isinstance(item, tuple) and item else item for item in failures.values()]
        pending += [found.__cause__, found.__context__]
    return None


@contextlib.contextmanager
def writing(path: str | Path, cleanup: Path | None = None) -> Iterator[None]:
    """A write into `path` that fails for a reason of the file system (full, read-only, not permitted) becomes one
    line naming the path, whatever library raised it (torch says 'unexpected pos', safetensors 'I/O error'); the
    half-written `cleanup` (a file or folder) is removed first, so a full disk is not left full."""
    path = Path(path)
    try:
        yield
    except BaseException as error:
        if not is_error(error):  # Ctrl-C, an exit, a preemption's stop: not the file system's
            raise
        reason = file_system_reason(error)
        try:
            full = shutil.disk_usage(_existing(path)).free < 1 << 20
        except OSError:
            full = False
        if full:
            reason = NO_SPACE
        if cleanup is not None:
            if cleanup.is_dir():
                shutil.rmtree(cleanup, ignore_errors=True)
            else:
                cleanup.unlink(missing_ok=True)
        if reason is None:
            raise
        from ddp_accel.errors import UserError

        raise UserError(f"cannot write {path}: {reason}; free space or pick another --output-dir") from None
