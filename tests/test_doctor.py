"""`ddp-accel doctor` under the launcher you train with: a table when all is well, one line per problem."""

import os
import re
import shutil
import subprocess
import time

import pytest
from helpers import BIN, ROOT, free_port

from ddp_accel.__main__ import main
from ddp_accel.doctor import Report, compare, data_fingerprint, loopback_problem


@pytest.mark.multiprocess
def test_two_processes_all_well_print_a_table_and_exit_0(tmp_path):
    command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port())]
    (tmp_path / "data" / "cat").mkdir(parents=True)
    (tmp_path / "data" / "cat" / "1.jpg").write_bytes(b"x" * 10)
    command += ["-m", "ddp_accel", "doctor", "--output-dir", str(tmp_path / "out"), "--megabytes", "8"]
    command += ["--data", str(tmp_path / "data"), "--min-free-gb", "0.01"]  # this machine's disk is not the point
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if re.match(r"[01]\s+\S+\s+\S+\s+\S+\s+[\d.]+\s+\d+", line)]
    assert len(rows) == 2, done.stdout
    assert "doctor: all is well: 2 process(es) on 1 machine(s)" in done.stdout
    assert not list((tmp_path / "out").glob(".doctor_*")), "the marker file is removed"


def one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("doctor: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.inprocess
def test_a_port_nothing_listens_on_is_one_line_within_the_timeout(monkeypatch, capsys):
    port = free_port()
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    assert main(["doctor", "--timeout-s", "0.5"]) == 1
    assert time.monotonic() - started < 10
    line = one_line(capsys)
    assert f"nothing answers at MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in line and "rank 1" in line, line


@pytest.mark.inprocess
def test_a_wrong_master_address_is_one_line(monkeypatch, capsys):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid"}.items():
        monkeypatch.setenv(name, value)
    assert main(["doctor", "--timeout-s", "2"]) == 1
    assert "MASTER_ADDR=no-such-host.invalid does not resolve" in one_line(capsys)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # on 2 machines (1 process each): loopback cannot be it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert main(["doctor", "--timeout-s", "2"]) == 1
    assert "MASTER_ADDR=127.0.0.1 is a loopback address" in one_line(capsys)


@pytest.mark.inprocess
def test_a_host_name_that_resolves_to_loopback_names_the_interface_to_set():
    line = loopback_problem("node2", "127.0.1.1", True, None, ("10.77.0.2", "veth0"))
    assert line and "node2" in line and "GLOO_SOCKET_IFNAME=veth0" in line
    assert loopback_problem("node2", "127.0.1.1", True, "veth0", ("10.77.0.2", "veth0")) is None  # already set
    assert loopback_problem("node2", "127.0.1.1", False, None, ("127.0.0.1", "lo")) is None  # one machine


@pytest.mark.inprocess
def test_what_differs_between_machines_is_one_line_each():
    ours = {"python": "3.11.2", "torch": "2.14.1", "accelerate": "1.15.0", "ddp-accel": "0.1.0"}
    reports = [
        Report(rank=0, host="a", versions=ours, sees_output_dir=True, free_gb=50, clock=100.0),
        Report(rank=1, host="b", versions={**ours, "torch": "2.13.0"}, sees_output_dir=False, free_gb=1, clock=105.0),
    ]
    lines = compare(reports, "/shared/run")
    assert any("host b, rank 1: torch 2.13.0, where rank 0 (a) has torch 2.14.1" in line for line in lines), lines
    assert any("--output-dir /shared/run is not the folder rank 0 (a) writes to" in line for line in lines), lines
    assert any("host b: 1.0 GB free" in line for line in lines), lines
    assert any("host b: its clock is +5.0 s from rank 0's" in line for line in lines), lines
    assert compare(reports[:1], "/shared/run") == []


@pytest.mark.inprocess
def test_data_that_differs_between_machines_is_one_line(tmp_path):
    (tmp_path / "a" / "cat").mkdir(parents=True)
    (tmp_path / "a" / "cat" / "1.jpg").write_bytes(b"x" * 10)
    copy = tmp_path / "b"
    shutil.copytree(tmp_path / "a", copy)
    os.utime(copy / "cat" / "1.jpg", (1, 1))  # a copy has other file times: the same data
    assert data_fingerprint(str(tmp_path / "a")) == data_fingerprint(str(copy))
    (copy / "cat" / "2.jpg").write_bytes(b"y")
    reports = [
        Report(rank=0, host="a", data=data_fingerprint(str(tmp_path / "a"))),
        Report(rank=1, host="b", data=data_fingerprint(str(copy))),
    ]
    lines = compare(reports, None, "/data/cifar")
    assert len(lines) == 1 and "host b, rank 1: --data /data/cifar is 2 files, 11 bytes" in lines[0], lines


@pytest.mark.inprocess
@pytest.mark.parametrize("where", ["a file", "under a file", "a /proc path", "read-only"])
def test_an_output_dir_that_cannot_take_a_file_is_one_line_naming_why(tmp_path, capsys, monkeypatch, where):
    # doctor exists to report these: they ended in a 12-line traceback from its own marker, on every rank
    (tmp_path / "file").write_text("x")
    output_dir = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "run"}.get(where)
    if where == "a /proc path":
        output_dir = "/proc/ddp_accel_doctor"
    if where == "read-only":
        output_dir = tmp_path / "ro"

        def refused(self, *args, **kwargs):
            raise OSError(30, "Read-only file system", str(self))

        monkeypatch.setattr("pathlib.Path.write_text", refused)  # (a read-only mount, without mounting one)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["doctor", "--output-dir", str(output_dir)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("doctor: ")]
    assert len(lines) == 1 and f"--output-dir {output_dir}: cannot write under it (" in lines[0], err[-2000:]
    assert "Traceback" not in err
    reason = {"a file": "is a file", "under a file": "is a file", "read-only": "Read-only file system"}.get(where)
    assert reason is None or reason in lines[0], lines
