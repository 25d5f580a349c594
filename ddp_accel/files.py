"""Files written whole or not at all: written aside, then renamed into place (a crash leaves the old file)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `path`; once the block wrote it, it replaces `path` in one rename."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    with replaced_atomically(path) as partial:
        partial.write_text(text)


def write_json(path: str | Path, value: Any, indent: int = 2) -> None:
    write_text(path, json.dumps(value, indent=indent, default=str))
