"""Every shipped accelerate YAML loads with accelerate's own loader; those that can run on CPU do run."""

import json
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import BIN, ROOT, check_ok, free_port

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_every_topology_has_a_config():
    assert {path.stem for path in CONFIGS} >= {"cpu", "single_gpu", "multi_gpu", "multi_node", "fsdp"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_documents_itself(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    first_lines = path.read_text().splitlines()[:3]
    assert all(line.startswith("#") for line in first_lines), "each YAML opens with a comment block"
    result = subprocess.run(
        [sys.executable, "-m", "ddp_accel", "check-config", str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name,world_size", [("cpu", 1), ("single_gpu", 1), ("multi_gpu", 2)])
def test_cpu_runnable_configs_launch(tmp_path, name, world_size):
    result = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / f"{name}.yaml"),
            "--main_process_port",
            str(free_port()),
            str(ROOT / "scripts" / "minimal.py"),
            "--output-dir",
            str(tmp_path),
            "--epochs",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    check_ok(result)
    assert json.loads((tmp_path / "metrics.json").read_text())["world_size"] == world_size
