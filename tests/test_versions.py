"""The versions declared are the versions proven: requirements.txt's lower bounds, pyproject.toml's dependencies and
ddp_accel/versions.py's tested ranges say the same, and a process outside those ranges says so in one line."""

import re
import tomllib

import pytest
from helpers import ROOT

from ddp_accel import versions

inprocess = pytest.mark.inprocess


def lower_bounds(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        match = re.match(r"^([A-Za-z0-9_.\-\[\]]+)>=([0-9.]+)$", line.split("#")[0].strip())
        if match:
            found[match.group(1)] = match.group(2)
    return found


@inprocess
def test_requirements_pyproject_and_the_tested_ranges_declare_one_floor():
    required = lower_bounds((ROOT / "requirements.txt").read_text().splitlines())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert lower_bounds(project["dependencies"]) == required
    oldest_python = versions.TESTED["python"][0]
    assert project["requires-python"] == f">={oldest_python[0]}.{oldest_python[1]}"
    for package in ("torch", "torchvision", "accelerate", "datasets"):
        assert versions.major_minor(required[package]) == versions.TESTED[package][0], package
    assert not any("<" in line for line in (ROOT / "requirements.txt").read_text().splitlines()), "no upper bound"


@inprocess
def test_a_version_outside_the_tested_range_is_one_line_naming_the_range():
    inside = {"python": "3.12.1", "torch": "2.14.1+cu130", "accelerate": "1.10.0", "datasets": "5.2.0"}
    assert versions.untested_line(inside) is None
    line = versions.untested_line({**inside, "torch": "2.15.0", "accelerate": "1.9.0"})
    assert line == (
        "note: this runs torch 2.15.0 (tested: 2.9 to 2.14), accelerate 1.9.0 (tested: 1.10 to 1.16); results outside "
        "the tested versions are not proven"
    )
    assert versions.major_minor("2.16.0.dev20261201+cpu") == (2, 16) and versions.major_minor("main") is None


@inprocess
def test_a_run_outside_the_tested_versions_says_so_at_its_start(tmp_path, monkeypatch):
    from helpers import check_ok, run_script

    monkeypatch.setattr(versions, "installed", lambda: {"torch": "2.99.0"})
    result = run_script("scripts/minimal.py", "--output-dir", tmp_path)
    check_ok(result)
    assert result.stderr.count("note: this runs torch 2.99.0 (tested: 2.9 to 2.14)") == 1, result.stderr[-2000:]
