"""Files written whole or not at all: written aside, then renamed into place (a crash leaves the old file)."""

from __future__ import annotations

import contextlib
import json
import math
import os
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
