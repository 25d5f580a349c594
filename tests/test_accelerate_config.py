"""`accelerate config` answered through a pseudo-terminal (its arrow-key menus need a TTY), then a real launch
with the YAML it wrote; and `accelerate config default`."""

import os
import subprocess

import pytest
from helpers import BIN, ROOT, free_port
from test_minimal import assert_one_world_of_two

from ddp_accel.__main__ import main as ddp_accel_main

pexpect = pytest.importorskip("pexpect")

# question (regex) -> answer; menus take the option's number, then Enter. One machine, 2 processes ("GPUs":
# on a CPU-only machine ddp_accel turns this into 2 gloo CPU processes).
QUESTIONNAIRE = [
    (r"In which compute environment", "0\r"),  # This machine
    (r"Which type of machine", "4\r"),  # multi-GPU
    (r"How many different machines", "1\r"),
    (r"checked while running for errors", "no\r"),
    (r"torch dynamo", "no\r"),
    (r"DeepSpeed", "no\r"),
    (r"FullyShardedDataParallel", "no\r"),
    (r"Megatron-LM", "no\r"),
    (r"How many GPU\(s\) should be used", "2\r"),
    (r"What (GPU|CPU)\(s\) \(by id\)", "all\r"),  # (Accelerate 1.16 names CPUs on a machine without GPUs)
    (r"numa efficiency", "no\r"),
    (r"mixed precision", "0\r"),  # no
]


@pytest.mark.multiprocess
def test_questionnaire_writes_a_yaml_that_launches_two_processes(tmp_path):
    config = tmp_path / "my_config.yaml"
    child = pexpect.spawn(
        str(BIN / "accelerate"),
        ["config", "--config_file", str(config)],
        encoding="utf-8",
        timeout=60,
        dimensions=(50, 200),
        env={**os.environ, "TERM": "xterm"},
    )
    try:
        for question, answer in QUESTIONNAIRE:
            child.expect(question)
            child.send(answer)
        child.expect("configuration saved at")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    text = config.read_text()
    assert "distributed_type: MULTI_GPU" in text and "num_processes: 2" in text
    result = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(free_port()),
            "scripts/minimal.py",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert_one_world_of_two(output, tmp_path / "out")  # scripts/minimal.py under accelerate launch


@pytest.mark.multiprocess
def test_config_default_writes_a_valid_file(tmp_path):
    config = tmp_path / "default.yaml"
    result = subprocess.run(
        [str(BIN / "accelerate"), "config", "default", "--config_file", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and config.is_file(), result.stdout + result.stderr
    assert ddp_accel_main(["check-config", str(config)]) == 0
