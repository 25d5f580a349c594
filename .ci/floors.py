"""Does CI's floor side prove what a user who pins one floor gets? (run by .ci/versions on the floor side)

The floor side installs every runtime requirement at its lower bound at once. A user pins one (`tensorboard==2.15`)
and pip resolves the rest, the newest it can. Where another floor caps a package that the pinned one depends on
(matplotlib 3.8.0 caps numpy below 2), the floor side proves the pinned one with a version of that package its user
never gets. This resolves each floor alone (pip's own resolver, `--dry-run --report`, nothing installed) and
compares every package it depends on with the floor side's: another major version is one line naming the floor,
the package and both versions, and the exit status is 1.

    python .ci/floors.py --python .venv-floor/bin/python     # the floor side's set as installed there
    python .ci/floors.py --python python3.11 --resolve       # the floor side's set as pip would resolve it
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def floors(requirements: Path) -> dict[str, str]:
    """name -> its lower bound, from requirements.txt's `name>=X` lines."""
    found = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            if lower:
                found[canonicalize_name(requirement.name)] = lower[0]
    return found


def resolve(python: str, requirements: Path, pins: list[str]) -> dict[str, dict]:
    """What pip installs for requirements.txt with `pins` (`name==version`) and the rest as pip chooses: name ->
    (version, the names it depends on), for `python`'s platform."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [python, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report)]
        command += ["-r", str(requirements), *pins]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        items = json.loads(report.read_text())["install"]
    environment = marker_environment(python)
    resolved = {}
    for item in items:
        metadata = item["metadata"]
        depends = []
        for line in metadata.get("requires_dist") or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": ""}):
                depends.append(canonicalize_name(requirement.name))
        resolved[canonicalize_name(metadata["name"])] = {"version": metadata["version"], "depends": depends}
    return resolved


def marker_environment(python: str) -> dict[str, str]:
    code = "import json; from packaging.markers import default_environment as e; print(json.dumps(e()))"
    try:
        return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)
    except subprocess.CalledProcessError:  # (no packaging there: this interpreter's is as good for the markers)
        return default_environment()


def installed(python: str) -> dict[str, str]:
    code = "import json, importlib.metadata as m; print(json.dumps({d.name: d.version for d in m.distributions()}))"
    listing = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)
    return {canonicalize_name(name): version for name, version in listing.items()}


def major(version: str) -> str:
    """A version's first number: where a package's interface may change (numpy 1 and 2, huggingface-hub 1 and 2)."""
    return re.split(r"[.+]", version)[0]


def unproven(floor_set: dict[str, str], alone: dict[str, dict[str, dict]], declared: set[str]) -> list[str]:
    """For each floor resolved alone, each package it depends on (not one of the declared requirements, which
    CI proves at both ends) whose major version there is not the floor side's."""
    lines = []
    for name, resolved in sorted(alone.items()):
        for package in sorted(set(resolved[name]["depends"]) - declared):
            theirs, ours = resolved.get(package, {}).get("version"), floor_set.get(package)
            if theirs is not None and ours is not None and major(ours) != major(theirs):
                lines.append(
                    f"{name} {resolved[name]['version']} is proven with {package} {ours}, but a user who pins only "
                    f"it gets {package} {theirs}: raise a floor that caps {package}, or declare {package}"
                )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the floor side's interpreter (its pip resolves)")
    parser.add_argument("--resolve", action="store_true", help="resolve the floor side too, instead of reading it")
    parser.add_argument("--requirements", type=Path, default=ROOT / "requirements.txt")
    args = parser.parse_args()
    bounds = floors(args.requirements)
    pins = {name: [f"{name}=={version}"] for name, version in bounds.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        every = pool.submit(resolve, args.python, args.requirements, sum(pins.values(), [])) if args.resolve else None
        futures = {name: pool.submit(resolve, args.python, args.requirements, pin) for name, pin in pins.items()}
        alone = {name: future.result() for name, future in futures.items()}
        floor_side = (
            {name: item["version"] for name, item in every.result().items()} if every else installed(args.python)
        )
    lines = unproven(floor_side, alone, set(bounds))
    for line in lines:
        print(f"floor not proven: {line}", file=sys.stderr)
    if not lines:
        print(f"floors: each of {len(bounds)} floors, pinned alone, meets the major versions the floor side has")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
