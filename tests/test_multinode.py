"""accelerate_configs/multi_node.yaml as 2 machines on one host: two `accelerate launch --machine_rank 0|1` (or
`ddp-accel launch`, which watches the wait for the other machines)."""

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest
from helpers import BIN, ROOT, free_port, start_node, wait_for, wait_nodes

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
        # static: through `ddp-accel launch` (the same accelerate launch, its wait watched)
        launcher = (
            [str(BIN / "ddp-accel"), "launch"] if rdzv_backend == "static" else [str(BIN / "accelerate"), "launch"]
        )
        command = [
            *launcher,
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
    # (not anchored at a line's start: two ranks' unbuffered prints can share a line, each before its newline)
    reports = [re.findall(r"rank (\d+) local_rank (\d+) world_size (\d+)", out) for out in outputs]
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


def launch_alone(machine_rank: int, port: int, tmp_path, *extra: str):
    command = [str(BIN / "ddp-accel"), "launch", "--join-timeout-s", "12", "--wait-report-s", "4", *extra]
    command += ["--config_file", str(MULTI_NODE_YAML), "--machine_rank", str(machine_rank), "--main_process_ip"]
    command += ["127.0.0.1", "--main_process_port", str(port), "scripts/minimal.py", "--output-dir", str(tmp_path)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True
    )


@pytest.mark.multiprocess
def test_a_machine_alone_says_what_it_waits_for_ends_at_the_bound_and_stops_on_ctrl_c(tmp_path):
    # accelerate launch alone waited in silence for 15 minutes (torch's rendezvous) and ignored Ctrl-C
    first, second = free_port(), free_port()
    started = time.monotonic()
    machine_0 = launch_alone(0, first, tmp_path / "a")  # the other machine never comes
    machine_1 = launch_alone(1, second, tmp_path / "b")  # machine 0 never comes: nothing listens at its port
    lines_1 = []
    for line in machine_1.stdout:  # the first report comes within seconds
        lines_1.append(line)
        if line.startswith("ddp-accel launch: machine 1 of 2 waiting"):
            break
    said_s = time.monotonic() - started
    machine_1.send_signal(signal.SIGINT)  # Ctrl-C
    out_1, _ = machine_1.communicate(timeout=30)
    stopped_s = time.monotonic() - started
    out_0, _ = machine_0.communicate(timeout=60)
    ended_s = time.monotonic() - started
    assert f"nothing answers at 127.0.0.1:{second}: machine 0 is not started yet" in lines_1[-1], lines_1
    assert machine_1.returncode == 130 and "stopped while machine 1 of 2 waited" in out_1, out_1[-2000:]
    assert machine_0.returncode == 1, out_0[-3000:]
    reports = [line for line in out_0.splitlines() if line.startswith("ddp-accel launch: machine 0 of 2 waiting")]
    errors = [line for line in out_0.splitlines() if line.startswith("error:")]
    assert len(reports) >= 2 and f"listening on port {first}" in reports[0], out_0[-3000:]
    assert len(errors) == 1 and f"the group did not form at 127.0.0.1:{first} within --join-timeout-s 12" in errors[0]
    assert said_s < 30 and stopped_s < said_s + 15 and ended_s < 60, (said_s, stopped_s, ended_s)
    for port in (first, second):  # the launchers and their agents are gone: nothing holds the ports
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, port


@pytest.mark.inprocess
def test_only_a_child_that_runs_the_script_is_taken_for_the_training(tmp_path):
    # the join watch ended when the launcher had any child: a short-lived helper of its own (before the group formed)
    # was taken for the training, and a lone machine then waited without its bound or reports
    from ddp_accel.elastic import child_processes
    from ddp_accel.launch import training_started

    def runs_sleep(launcher: subprocess.Popen) -> bool:
        return any(command.split(b"\0")[:1] == [b"sleep"] for _, command in child_processes(launcher.pid))

    helper_only = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    training = subprocess.Popen(
        ["sh", "-c", "python3 -c 'import time; time.sleep(30)' scripts/minimal.py --output-dir out & wait"],
        start_new_session=True,
    )
    try:
        wait_for(lambda: runs_sleep(helper_only), timeout=10, what="the helper's sleep")
        assert not training_started(helper_only, "scripts/minimal.py")
        wait_for(lambda: training_started(training, "scripts/minimal.py"), timeout=10, what="the script's process")
        assert training_started(training, str(ROOT / "scripts" / "minimal.py"))  # the same script by another path
        assert not training_started(training, "scripts/imdb.py")
    finally:
        for launcher in (helper_only, training):
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.inprocess
def test_a_machine_rank_or_process_count_the_config_cannot_form_is_one_line(capsys):
    from ddp_accel import launch

    base = ["--config_file", str(MULTI_NODE_YAML), "scripts/minimal.py"]
    assert launch.main(["--machine_rank", "2", *base]) == 2
    assert "--machine_rank 2 cannot join a group of 2 machines" in capsys.readouterr().err
    assert launch.main(["--num_processes", "3", *base]) == 2
    assert "num_processes 3 is not a multiple of num_machines 2" in capsys.readouterr().err
    # an address no machine can reach: one line at once (a traceback; a wait until the bound that never said why)
    assert launch.main(["--main_process_port", "70000", *base]) == 2
    assert "main_process_port 70000 is not a port: give one from 1 to 65535" in capsys.readouterr().err
    assert launch.main(["--main_process_ip", "256.1.1.1", *base]) == 2
    assert "main_process_ip 256.1.1.1 is neither an IP address nor a name this machine can resolve" in (
        capsys.readouterr().err
    )


@pytest.mark.inprocess
def test_machine_0_alone_says_none_connected_without_counting_itself(monkeypatch):
    from ddp_accel import launch

    setup = {"address": "127.0.0.1", "port": 1, "machines": 2, "machine_rank": 0}
    monkeypatch.setattr(launch, "connected_peers", lambda port: [])
    assert launch.what_is_seen(setup).endswith("connected from: none yet")
    monkeypatch.setattr(launch, "connected_peers", lambda port: ["127.0.0.1"])
    assert launch.what_is_seen(setup).endswith("connected from: 127.0.0.1 (this machine's own agent among them)")


@pytest.mark.multiprocess
def test_a_group_that_never_gets_its_last_rank_ends_at_the_bound_in_one_line_on_each_rank(tmp_path):
    # ranks 0 and 1 of 3 (the third never starts): torch's rendezvous waits in C++ past --timeout-s; each rank ends
    # by --timeout-s plus the grace with one line, no frames of torch's
    import subprocess
    import sys

    from helpers import assert_nothing_left

    base = {**os.environ, "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    base.update(OMP_NUM_THREADS="1", DDP_ACCEL_CURVES="0")
    command = [sys.executable, str(ROOT / "scripts" / "minimal.py"), "--output-dir", str(tmp_path), "--timeout-s", "3"]
    ranks = []
    for rank in (0, 1):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True))
    started = time.monotonic()
    outputs = [rank.communicate(timeout=120)[1] for rank in ranks]
    waited = time.monotonic() - started
    for rank, process in enumerate(ranks):
        assert_nothing_left(process.pid, command)
        errors = [line for line in outputs[rank].splitlines() if line.startswith("error: ")]
        assert process.returncode == 2 and len(errors) == 1, outputs[rank][-2000:]
        assert f"rank {rank} of 3: the process group did not form within --timeout-s 3" in errors[0], errors
        assert "frame #" not in outputs[rank], outputs[rank][-2000:]
    from ddp_accel import group_wait

    assert waited < 3 + group_wait.BOUND_GRACE_S + 15, waited  # (the imports: a few seconds on 2 loaded cores)


SIGNALLED_WHILE_THE_GROUP_FORMS = """
import os, signal, sys, time
from ddp_accel import group_wait
os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
signal.signal(signal.SIGTERM, lambda *_: (print("the script's handler ran", flush=True), os._exit(9)))
with group_wait.while_the_group_forms(60, sys.argv[1]):
    os.kill(os.getpid(), signal.SIGTERM)  # in Python, between two of torch's C++ calls
    if sys.argv[2] == "during":
        time.sleep(20)
print("not ended", flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("moment", ["during", "at-the-end"])
def test_a_signal_while_the_group_forms_is_acted_on_once_by_the_watcher(tmp_path, moment):
    # the script's own handler and the watcher both acted on a signal that came while the main thread ran Python
    # (a Ctrl-C exited 130 without its line, a preemption left a marker without its moment); one that came as the
    # group formed was lost once the handlers were the script's again
    import subprocess
    import sys

    command = [sys.executable, "-c", SIGNALLED_WHILE_THE_GROUP_FORMS, str(tmp_path), moment]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0 and result.stdout == "", (result.stdout, result.stderr[-2000:])
    marker = json.loads((tmp_path / "preempted.json").read_text())
    assert marker["moment"] == "rendezvous" and marker["signal"] == "SIGTERM", marker


BLOCKED_PAST_THE_BOUND = """
import os, sys, time
from ddp_accel import launch_environments, group_wait
os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
with group_wait.while_the_group_forms(1, None):
    time.sleep(30)  # as torch's rendezvous, stuck in C++ past its own timeout
print("not ended", flush=True)
"""


@pytest.mark.multiprocess
def test_a_rendezvous_still_waiting_past_the_bound_is_ended_by_the_watcher_in_one_line():
    # whatever torch's rendezvous still waits for at --timeout-s + the grace: the process ends, exit 2, one line
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_PAST_THE_BOUND], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and "not ended" not in result.stdout, (result.stdout, result.stderr[-2000:])
    assert len(errors) == 1 and "rank 0 of 2: the process group did not form within --timeout-s 1" in errors[0]
