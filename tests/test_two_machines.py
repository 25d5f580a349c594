"""accelerate_configs/multi_node.yaml on two "machines" with addresses of their own: two network namespaces joined
by a veth pair (10.77.N.1 and 10.77.N.2). The link is cut mid-training: both machines end within the collective
timeout, each with one line; a restart with --resume-from-checkpoint latest ends bitwise equal to an uninterrupted
run. The namespaces are created and deleted here; traffic goes only to the addresses made here."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import BIN, ROOT, STANDARD_PROBE_ARGS, free_port, wait_for_checkpoint, weights

MULTI_NODE_YAML = ROOT / "accelerate_configs" / "multi_node.yaml"
PROBE_ARGS = [*STANDARD_PROBE_ARGS, "--step-ms", "30", "--timeout-s", "10"]


def namespaces_available() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2's ip to make network namespaces"
    probe = f"ddpa_probe_{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"cannot make network namespaces here ({made.stderr.strip()})"


pytestmark = pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_machines():
    """Two namespaces, A (10.77.N.1 on veth a) and B (10.77.N.2 on veth b); deleted afterwards."""
    tag, subnet = os.getpid() % 10000, 10 + os.getpid() % 200
    a, b, veth_a, veth_b = f"ddpa_a{tag}", f"ddpa_b{tag}", f"ddpa{tag}", f"ddpb{tag}"
    ip("netns", "add", a)
    ip("netns", "add", b)
    try:
        ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        ip("link", "set", veth_a, "netns", a)
        ip("link", "set", veth_b, "netns", b)
        for space, veth, host in ((a, veth_a, 1), (b, veth_b, 2)):
            ip("-n", space, "addr", "add", f"10.77.{subnet}.{host}/24", "dev", veth)
            ip("-n", space, "link", "set", veth, "up")
            ip("-n", space, "link", "set", "lo", "up")
        yield {"namespaces": (a, b), "veths": (veth_a, veth_b), "address": f"10.77.{subnet}.1"}
    finally:
        for space in (a, b):
            subprocess.run(["ip", "netns", "pids", space], capture_output=True)
            subprocess.run(["ip", "netns", "del", space], capture_output=True)  # deletes the veth pair too


def accelerate_launch(machines, rank: int, port: int, *target: str) -> list[str]:
    """`accelerate launch` with the multi-node YAML, as machine `rank`, the rendezvous on machine 0's address."""
    return [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(MULTI_NODE_YAML),
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        machines["address"],
        "--main_process_port",
        str(port),
        *target,
    ]


def start_machine(machines, rank: int, output_dir: Path, port: int, log: Path) -> subprocess.Popen:
    space, veth = machines["namespaces"][rank], machines["veths"][rank]
    command = [
        "ip",
        "netns",
        "exec",
        space,
        *accelerate_launch(machines, rank, port, str(ROOT / "tests" / "probe.py")),
        *PROBE_ARGS,
        "--output-dir",
        str(output_dir),
        "--resume-from-checkpoint",
        "latest",
    ]
    # gloo picks the interface its host name resolves to (loopback here): name the one between the machines
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": veth}
    return subprocess.Popen(
        command, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
    )


def run_both(machines, output_dir: Path, tmp_path: Path, attempt: str, cut_after_step: int | None = None):
    port = free_port()
    logs = [tmp_path / f"{attempt}_machine{rank}.log" for rank in (0, 1)]
    nodes = [start_machine(machines, 0, output_dir, port, logs[0])]
    time.sleep(3)  # machine 0 first, as a real second machine would join
    nodes.append(start_machine(machines, 1, output_dir, port, logs[1]))
    cut_at = None
    if cut_after_step is not None:
        wait_for_checkpoint(output_dir, cut_after_step, timeout=180, alive=nodes[0])
        time.sleep(0.3)
        ip("-n", machines["namespaces"][1], "link", "set", machines["veths"][1], "down")
        cut_at = time.monotonic()
    codes = []
    for node in nodes:
        try:
            codes.append(node.wait(timeout=240))
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, 9)
            codes.append(None)
    ended_s = time.monotonic() - cut_at if cut_at else None
    return codes, [log.read_text() for log in logs], ended_s


@pytest.mark.system
def test_two_machines_with_their_own_addresses_survive_a_cut_link(two_machines, tmp_path, standard_reference):
    output_dir = tmp_path / "run"
    codes, logs, ended_s = run_both(two_machines, output_dir, tmp_path, "cut", cut_after_step=5)
    assert all(code not in (0, None) for code in codes), (codes, logs[0][-2000:], logs[1][-2000:])
    for rank, log in enumerate(logs):
        ours = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(ours) == 1 and "lost contact" in ours[0], (rank, log[-3000:])
    assert ended_s < 10 + 60, f"the machines took {ended_s:.0f} s to give up"

    ip("-n", two_machines["namespaces"][1], "link", "set", two_machines["veths"][1], "up")
    codes, logs, _ = run_both(two_machines, output_dir, tmp_path, "resume")
    assert codes == [0, 0], (codes, logs[0][-3000:], logs[1][-3000:])
    assert "resumed from" in logs[0] and "world_size" in logs[0]

    a, b = weights(standard_reference), weights(output_dir)  # the same job on one host, uninterrupted
    assert all(torch.equal(a[key], b[key]) for key in a)
    print(
        f"\nlink cut after step 5: both machines ended {ended_s:.1f} s later (--timeout-s 10); resumed from "
        f"{[line for line in logs[0].splitlines() if 'resumed from' in line][0].split(': ')[1]}",
        file=sys.stderr,
    )


def doctor_on(
    machines,
    rank: int,
    port: int,
    output_dir: Path,
    name_interface: bool,
    private_dir: bool = False,
    env_extra: dict | None = None,
):
    """`ddp-accel doctor` on one machine, under accelerate launch with the multi-node YAML; `private_dir`: the output
    dir is a folder of this machine only (a mount namespace with its own tmpfs there)."""
    launch_doctor = accelerate_launch(
        machines, rank, port, "-m", "ddp_accel", "doctor", "--output-dir", str(output_dir)
    )
    # free disk is this machine's own (CI's had 4.5 GB): test_mechanisms proves the threshold
    launch_doctor += ["--timeout-s", "20", "--megabytes", "4", "--min-free-gb", "0.01"]
    inner = launch_doctor
    if private_dir:
        quoted = " ".join(f"'{part}'" for part in launch_doctor)
        inner = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs none '{output_dir}' && exec {quoted}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    if name_interface:
        env["GLOO_SOCKET_IFNAME"] = machines["veths"][rank]
    command = ["ip", "netns", "exec", machines["namespaces"][rank], *inner]
    # run from the output dir's parent: from the project root, its ddp_accel.egg-info would come first on the path
    cwd = output_dir.parent
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)


def doctor_both(machines, tmp_path: Path, name_interface=True, private_dir=False, machine_1_env: dict | None = None):
    output_dir, port = tmp_path / "shared_run", free_port()
    output_dir.mkdir(exist_ok=True)
    nodes = [
        doctor_on(
            machines, rank, port, output_dir, name_interface, private_dir and rank == 1, machine_1_env if rank else None
        )
        for rank in (0, 1)
    ]
    return [(node.wait(timeout=120), node.stdout.read()) for node in nodes]


@pytest.mark.system
def test_doctor_on_two_machines_reports_all_well_or_one_line_per_problem(two_machines, tmp_path):
    started = time.monotonic()
    (code_0, out_0), (code_1, _) = doctor_both(two_machines, tmp_path)
    assert (code_0, code_1) == (0, 0), out_0[-3000:]
    assert "doctor: all is well: 2 process(es) on 2 machine(s)" in out_0, out_0[-3000:]
    assert two_machines["address"] in out_0 and two_machines["veths"][0] in out_0  # the address gloo uses

    # the host name resolves to loopback on these machines (as on many clusters): without GLOO_SOCKET_IFNAME gloo
    # would listen there; each machine says so, naming its interface, before any rendezvous
    reported: list[str] = []
    results = doctor_both(two_machines, tmp_path, name_interface=False)
    for rank, (code, out) in enumerate(results):
        lines = [line for line in out.splitlines() if line.startswith("doctor: ")]
        assert code != 0 and len(lines) == 1, out[-3000:]
        assert f"GLOO_SOCKET_IFNAME={two_machines['veths'][rank]}" in lines[0], lines
        reported.append(lines[0])

    # machine 1 sees a folder of its own at --output-dir (checkpoints would not reach machine 0) and has another
    # ddp-accel installed (its metadata first on the path, as a stale install would be): one line for each
    other = tmp_path / "other_install" / "ddp_accel-9.9.9.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: ddp-accel\nVersion: 9.9.9\n")
    machine_1_env = {"PYTHONPATH": str(other.parent)}
    (code_0, out_0), _ = doctor_both(two_machines, tmp_path, private_dir=True, machine_1_env=machine_1_env)
    lines = [line for line in out_0.splitlines() if line.startswith("doctor: ")]
    assert code_0 == 1 and len(lines) == 2, out_0[-3000:]
    assert any("rank 1: --output-dir" in line and "is not the folder rank 0" in line for line in lines), lines
    assert any("rank 1: ddp-accel 9.9.9, where rank 0" in line for line in lines), lines
    print("\n" + "\n".join(reported + lines), file=sys.stderr)
    assert time.monotonic() - started < 150
