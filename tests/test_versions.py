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
    assert lower_bounds([*project["dependencies"], *project["optional-dependencies"]["text"]]) == required
    # the IMDB script's datasets is an extra: installed, Accelerate imports it (with pyarrow and pandas) for every
    # loader it prepares on 2+ processes, whatever the data
    assert "datasets" not in lower_bounds(project["dependencies"])
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


def ci_floors():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ci_floors", ROOT / ".ci" / "floors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@inprocess
def test_a_floor_proven_only_under_another_floor_s_cap_is_named():
    # CI's floor side installs every floor at once; a user pins one and pip resolves the rest. matplotlib 3.8.0
    # capped numpy below 2, so tensorboard 2.15 passed CI with numpy 1 and failed its users with numpy 2
    # (np.string_): .ci/floors.py compares what each floor, resolved alone, depends on with the floor side's
    floors = ci_floors()
    bounds = floors.floors(ROOT / "requirements.txt")
    assert bounds == {
        name.lower(): bound
        for name, bound in lower_bounds((ROOT / "requirements.txt").read_text().splitlines()).items()
    }
    floor_side = {"numpy": "1.26.4", "protobuf": "4.25.1", "torch": "2.9.0+cpu", "huggingface-hub": "1.33.0"}
    alone = {
        "tensorboard": {
            "tensorboard": {"version": "2.15.0", "depends": ["numpy", "protobuf", "six"]},
            "numpy": {"version": "2.4.6", "depends": []},
            "protobuf": {"version": "4.23.4", "depends": []},  # (the same major version)
        },
        "accelerate": {
            "accelerate": {"version": "1.10.0", "depends": ["torch", "huggingface-hub"]},
            "torch": {"version": "2.14.1", "depends": []},  # (declared: proven at both ends)
            "huggingface-hub": {"version": "2.4.0", "depends": []},
        },
    }
    lines = floors.unproven(floor_side, alone, {"tensorboard", "accelerate", "torch"})
    assert len(lines) == 2, lines
    assert lines[0].startswith("accelerate 1.10.0 is proven with huggingface-hub 1.33.0, but a user who pins only it")
    assert "tensorboard 2.15.0 is proven with numpy 1.26.4, but a user who pins only it gets numpy 2.4.6" in lines[1]
    floor_side["numpy"], floor_side["huggingface-hub"] = "2.3.0", "2.0.1"
    assert floors.unproven(floor_side, alone, {"tensorboard", "accelerate", "torch"}) == []
