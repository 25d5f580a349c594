"""Mistakes a user can make end in one clear line and a non-zero exit, never a traceback."""

import subprocess
import sys

import pytest

from conftest import ROOT, assert_clean_error, check_ok, launch
from ddp_accel.errors import UserError
from ddp_accel.runtime import check_topology


def test_resume_path_that_does_not_exist(tmp_path):
    result = launch("scripts/minimal.py", "--output-dir", tmp_path, "--resume-from-checkpoint",
                    tmp_path / "nope", launcher="python")
    assert_clean_error(result, "no such checkpoint", "latest")


def test_resume_path_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    result = launch("scripts/minimal.py", "--output-dir", tmp_path, "--resume-from-checkpoint",
                    tmp_path / "empty", launcher="python")
    assert_clean_error(result, "not a complete ddp_accel checkpoint")


def test_checkpoint_of_another_model(tmp_path):
    check_ok(launch("tests/probe.py", "--output-dir", tmp_path, "--max-steps", 2, "--checkpointing-steps", 2,
                    "--hidden", 8, launcher="python"))
    result = launch("tests/probe.py", "--output-dir", tmp_path / "other", "--hidden", 16,
                    "--resume-from-checkpoint", tmp_path / "checkpoints" / "step_2", launcher="python")
    assert_clean_error(result, "another model")


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    result = launch("scripts/minimal.py", "--output-dir", tmp_path / "file", launcher="python")
    assert_clean_error(result, "is a file")


def test_unknown_yaml_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "accelerate_configs" / "multi_gpu.yaml").read_text() + "num_proceses: 4\n")
    result = subprocess.run([sys.executable, "-m", "ddp_accel", "check-config", str(bad)],
                            capture_output=True, text=True, cwd=ROOT)
    assert_clean_error(result, "unknown keys", "num_proceses")


def test_two_process_bad_input_exits_nonzero(tmp_path):
    result = launch("scripts/minimal.py", "--output-dir", tmp_path, "--resume-from-checkpoint",
                    tmp_path / "nope", nproc=2)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert sum(line.startswith("error: ") for line in output.splitlines()) == 1, output[-3000:]


def test_world_size_guard(monkeypatch):
    class OneProcess:
        num_processes = 1
        distributed_type = "DistributedType.NO"

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="each would train alone"):
        check_topology(OneProcess())
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_topology(OneProcess())
