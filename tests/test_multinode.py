"""accelerate_configs/multi_node.yaml as 2 machines on one host: two `accelerate launch --machine_rank 0|1`."""

import re
import socket
import time

import pytest
from helpers import BIN, ROOT, free_port, start_node, wait_nodes

MULTI_NODE_YAML = ROOT / "accelerate_configs" / "multi_node.yaml"


def wait_listening(port: int, process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"machine 0 never listened on port {port}")


@pytest.mark.parametrize("rdzv_backend,per_machine", [("static", 1), ("c10d", 2)])
@pytest.mark.multiprocess
def test_two_machines_on_one_host(tmp_path, rdzv_backend, per_machine):
    port = free_port()
    machines = []
    for machine_rank in (0, 1):
        command = [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(MULTI_NODE_YAML),
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "--num_processes",
            str(2 * per_machine),
            "--rdzv_backend",
            rdzv_backend,
            "scripts/minimal.py",
            "--output-dir",
            str(tmp_path / "out"),
        ]
        machines.append(start_node(command))
        if machine_rank == 0:
            # machine 0's `accelerate launch` checks that the port is free; with c10d the other machine could
            # otherwise take it first (its agent hosts the store when it arrives first), so it joins once
            # machine 0 is listening, as a second real machine would
            wait_listening(port, machines[0])
    outputs = wait_nodes(machines)
    reports = [re.findall(r"^rank (\d+) local_rank (\d+) world_size (\d+)", out, re.M) for out in outputs]
    ranks = sorted(int(rank) for report in reports for rank, _, _ in report)
    assert ranks == list(range(2 * per_machine)), reports  # every global rank once, across both machines
    assert all(int(world) == 2 * per_machine for report in reports for _, _, world in report)
    assert all(len(report) == per_machine for report in reports)


@pytest.mark.multiprocess
def test_machines_that_disagree_on_the_number_of_processes_are_refused_on_every_machine(tmp_path):
    # `--num_processes 4` on machine 1 only: 1 + 2 processes trained at world size 3 and exited 0
    port, machines = free_port(), []
    for machine_rank, processes in ((0, 2), (1, 4)):
        command = [str(BIN / "accelerate"), "launch", "--config_file", str(MULTI_NODE_YAML), "--machine_rank"]
        command += [str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        command += ["--num_processes", str(processes), "scripts/minimal.py", "--output-dir", str(tmp_path / "out")]
        machines.append(start_node(command))
        if machine_rank == 0:
            wait_listening(port, machines[0])
    for machine in machines:
        out, _ = machine.communicate(timeout=240)
        assert machine.returncode != 0, out[-3000:]
        errors = [line for line in out.splitlines() if line.startswith("error: the machines run different numbers")]
        assert errors and "machine 0: 1, machine 1: 2; world size 3" in errors[0], out[-3000:]
    assert not (tmp_path / "out" / "model.safetensors").exists()
