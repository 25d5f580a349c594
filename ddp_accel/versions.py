"""The versions ddp-accel is proven on, and the line a process outside them says at its start.

CI (`.ci/run`) runs the suite on the newest Python these machines have with the newest libraries pip serves, and
the in-process tier and a launched set on the declared floor (requirements.txt's lower bounds); `TESTED` is the
range between them. requirements.txt admits newer versions (none is known to fail); a process that runs one, or one
below the floor (pip refuses those), says in one line which range was tested.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

# package -> (oldest, newest) major.minor proven by CI; the oldest is requirements.txt's lower bound
TESTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "python": ((3, 11), (3, 13)),
    "torch": ((2, 9), (2, 14)),
    "torchvision": ((0, 24), (0, 29)),
    "accelerate": ((1, 10), (1, 16)),
    "datasets": ((5, 1), (5, 2)),
}


def major_minor(version: str) -> tuple[int, int] | None:
    """(2, 14) of '2.14.1+cu130'; None for a version that does not start with two numbers."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def installed() -> dict[str, str]:
    found = {"python": ".".join(map(str, sys.version_info[:3]))}
    for package in TESTED:
        if package != "python":
            try:
                found[package] = metadata.version(package)
            except metadata.PackageNotFoundError:
                pass
    return found


def untested(versions: dict[str, str]) -> list[str]:
    """'torch 2.15.0 (tested: 2.9 to 2.14)' for each version outside its tested range."""
    outside = []
    for package, version in versions.items():
        found = major_minor(version)
        oldest, newest = TESTED[package]
        if found is not None and not oldest <= found <= newest:
            tested = f"{oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]}"
            outside.append(f"{package} {version} (tested: {tested})")
    return outside


def untested_line(versions: dict[str, str] | None = None) -> str | None:
    """The start-up line of a process that runs versions outside the tested ranges; None inside them."""
    outside = untested(installed() if versions is None else versions)
    if not outside:
        return None
    return f"note: this runs {', '.join(outside)}; results outside the tested versions are not proven"
