"""Every shipped accelerate YAML loads with accelerate's own loader; those that can run on CPU do run."""

import subprocess

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from helpers import BIN, ROOT, check_ok, free_port, metrics_of

from ddp_accel.__main__ import main as ddp_accel_main

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


@pytest.mark.inprocess
def test_every_topology_has_a_config():
    assert {path.stem for path in CONFIGS} >= {"cpu", "single_gpu", "multi_gpu", "multi_node", "fsdp"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
@pytest.mark.inprocess
def test_config_loads_and_documents_itself(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    first_lines = path.read_text().splitlines()[:3]
    assert all(line.startswith("#") for line in first_lines), "each YAML opens with a comment block"
    assert ddp_accel_main(["check-config", str(path)]) == 0


# multi_gpu.yaml with 2 processes: the shared short job (tests/conftest.py, accelerate launch); cpu.yaml:
# test_training.py's dynamo test launches it
@pytest.mark.parametrize("name,world_size", [("single_gpu", 1)])
@pytest.mark.multiprocess
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
    assert metrics_of(tmp_path)["world_size"] == world_size
