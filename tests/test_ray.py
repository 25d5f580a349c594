"""`ddp-accel ray`: the scripts on a Ray cluster (Ray Train), with the guarantees they have under torchrun.

One real Ray head node per module, started and stopped by its process group (never `ray stop`, which would stop
every Ray on the machine), with its own temp dir and HOME (Ray writes its auth token there); token authentication
is off: the node listens on loopback only."""

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    BIN,
    ROOT,
    STANDARD_PROBE_ARGS,
    free_port,
    kill_tree,
    metrics_of,
    session_members,
    wait_for,
    wait_for_checkpoint,
    weights,
)
from test_two_machines import namespaces_available, two_machines  # noqa: F401 (the fixture)

from ddp_accel import ray_launch

if importlib.util.find_spec("ray") is None:  # not imported here: the in-process test proves the driver does not either
    pytest.skip("Ray is not installed (pip install -e '.[ray]'; .ci/run installs it)", allow_module_level=True)

PROBE = str(ROOT / "tests" / "probe.py")
PROBE_ARGS = [*STANDARD_PROBE_ARGS, "--step-ms", "30"]


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on free ports; yields the environment a driver needs to reach it."""
    home = Path(tempfile.mkdtemp(prefix="ray_home_"))
    temp_dir = Path(tempfile.mkdtemp(prefix="ray_"))  # short: Ray's socket paths must fit in 107 bytes
    port = free_port()
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    log = temp_dir / "head.log"
    command = [str(BIN / "ray"), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1"]
    command += ["--temp-dir", str(temp_dir), "--num-cpus", "2", "--disable-usage-stats"]
    command += ["--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port())]
    dashboard = free_port()  # its job server takes `ray job submit`
    command += ["--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard)]
    head = subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "--block" in log.read_text(), timeout=120, alive=head, what="the Ray head node")
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard}"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError):  # whatever of the node is left: one session, started here
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        # SIGKILLed above: only their reaping (by init) can still be pending
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not session_members(head.pid), timeout=10, what="the node's processes to be reaped")
        left = session_members(head.pid)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"


def ray_driver(env: dict, output_dir: Path, *args: str, max_failures: int = 1, log: Path) -> subprocess.Popen:
    command = [str(BIN / "ddp-accel"), "ray", "--workers", "2", "--max-failures", str(max_failures), PROBE]
    command += [*PROBE_ARGS, *args, "--output-dir", str(output_dir)]
    return subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def pid_of(pids: Path, rank: int, start: int) -> int:
    """The process of `rank` in the group's `start`-th start (0: the first), from the probe's pid files."""
    files = sorted(pids.glob(f"rank{rank}.*"), key=lambda path: path.stat().st_mtime_ns)
    return int(files[start].suffix[1:])


def finish(driver: subprocess.Popen, timeout: float = 300) -> int | None:
    try:
        return driver.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)
        return None


@pytest.mark.multiprocess
def test_a_signalled_then_a_killed_ray_worker_restart_the_group_which_resumes_bitwise_and_a_user_error_is_final(
    ray_head, tmp_path, standard_reference
):
    output_dir, pids = tmp_path / "run", tmp_path / "pids"
    log = tmp_path / "driver.log"
    driver = ray_driver(ray_head, output_dir, "--pid-dir", str(pids), max_failures=2, log=log)
    try:
        # SIGTERM to rank 0's process (a pod eviction): the ranks agree on a step, save it and the group restarts
        wait_for_checkpoint(output_dir, 5, timeout=180, alive=driver)
        os.kill(pid_of(pids, rank=0, start=0), signal.SIGTERM)
        wait_for(lambda: (output_dir / "preempted.json").is_file(), timeout=60, alive=driver, what="preempted.json")
        stopped = json.loads((output_dir / "preempted.json").read_text())
        # then SIGKILL of rank 1's process in the restarted group (out of memory, a crash in a library)
        wait_for(lambda: len(list(pids.glob("rank*"))) == 4, timeout=120, alive=driver, what="the restarted group")
        wait_for_checkpoint(output_dir, 60, timeout=180, alive=driver)
        os.kill(pid_of(pids, rank=1, start=1), signal.SIGKILL)
        code = finish(driver)
    finally:
        kill_tree(driver)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert stopped["signal"] == "SIGTERM" and stopped["phase"] == "train", stopped
    assert len(list(pids.glob("rank*"))) == 6, sorted(p.name for p in pids.iterdir())  # two restarts of both ranks
    metrics = metrics_of(output_dir)
    assert metrics["end_reason"] == "completed" and metrics["resumed_from"], metrics
    assert metrics["launcher"].startswith("ray (2 workers on 1 node; SIGTERM/SIGUSR1 forwarded"), metrics["launcher"]
    assert "ray: training completed" in text and "checkpoints/step_95" in text, text[-2000:]
    assert (output_dir / "checkpoints" / "step_5").is_dir(), "Ray deleted none of our checkpoints"

    a, b = weights(standard_reference), weights(output_dir)  # the same job under torchrun, uninterrupted
    assert all(torch.equal(a[key], b[key]) for key in a), "weights differ from the uninterrupted torchrun run"

    # the same run folder with a model of another size: a user error the workers find (the checkpoint's identity),
    # ended with its one line, without a retry (each start writes a pid file)
    again, log = tmp_path / "pids_again", tmp_path / "mismatch.log"
    code = finish(ray_driver(ray_head, output_dir, "--hidden", "32", "--pid-dir", str(again), max_failures=3, log=log))
    text = log.read_text()
    assert code == 2, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--hidden" in errors[0], text[-4000:]
    assert len(list(again.glob("rank*"))) == 2, "a user error was retried"


@pytest.mark.multiprocess
def test_ray_job_submit_runs_the_command_on_the_cluster_and_fails_with_its_error_line(ray_head, tmp_path):
    # what docs/clusters.md gives: `ray job submit -- ddp-accel ray ...`; the job's driver runs on the head node
    # (RAY_API_SERVER_ADDRESS: the head's job server), with absolute paths since the job runs in Ray's own folder
    output_dir = tmp_path / "run"
    command = [str(BIN / "ray"), "job", "submit", "--", str(BIN / "ddp-accel"), "ray", "--workers", "2", PROBE]
    command += [*PROBE_ARGS, "--epochs", "1", "--output-dir", str(output_dir)]
    result = subprocess.run(command, env=ray_head, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    assert "ray: training completed" in result.stdout and "succeeded" in result.stdout, result.stdout[-3000:]
    metrics = metrics_of(output_dir)
    assert metrics["end_reason"] == "completed" and metrics["world_size"] == 2, metrics
    assert metrics["launcher"].startswith("ray (2 workers on 1 node"), metrics["launcher"]
    # a bad option: the job fails with the script's one line, found by the driver before any worker started
    bad = subprocess.run([*command, "--bogus"], env=ray_head, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "unrecognized arguments: --bogus" in bad.stdout, bad.stdout[-3000:]
    assert "RayTrainWorker" not in bad.stdout and "RayTrainWorker" in result.stdout, bad.stdout[-3000:]


@pytest.mark.inprocess
def test_the_driver_finds_bad_options_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    started = time.monotonic()
    ray_imported_before = {name: name in sys.modules for name in ("ray", "ray.train")}
    assert ray_launch.main(["--workers", "2", PROBE, "--epochs", "1", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert ray_launch.main(["--workers", "2", PROBE, "--output-dir", str(a_file)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: --output-dir {a_file} is a file")
    assert ray_launch.main([PROBE, "--help"]) == 0 and "--batch-size" in capsys.readouterr().out  # no Ray started
    assert ray_launch.main(["--workers", "0", PROBE]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    assert ray_launch.main(["--max-failures", "-1", PROBE]) == 2
    assert "endless retries" in capsys.readouterr().err
    assert ray_launch.main(["--resize-check-s", "0", PROBE]) == 2
    assert "--resize-check-s must be above 0, not 0" in capsys.readouterr().err
    # a cluster address where nothing answers: one line within --start-timeout-s (it waited until killed)
    address = f"127.0.0.1:{free_port()}"
    output_dir = tmp_path / "nowhere"
    assert (
        ray_launch.main(["--address", address, "--start-timeout-s", "0.5", PROBE, "--output-dir", str(output_dir)]) == 2
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"nothing answers at {address} (the Ray cluster's head" in errors[0], errors
    assert time.monotonic() - started < 30  # nothing was started: no Ray, no worker
    # each line came before Ray's import (half a second of CPU) and Ray Train's (a second; the address is tried first)
    assert all(before or name not in sys.modules for name, before in ray_imported_before.items())
    # where Ray is not installed: one line naming the extra
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    assert ray_launch.main(["--workers", "2", PROBE]) == 2
    assert "error: Ray is not installed here: pip install -e '.[ray]'" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_group_that_never_finds_room_ends_in_bounded_time_with_one_line(ray_head, tmp_path):
    # 3 workers of 1 CPU on a 2-CPU cluster: what a node that never returns leaves; Ray would otherwise retry
    # the start forever (its controller's failure limit is endless by default)
    command = [str(BIN / "ddp-accel"), "ray", "--workers", "3", "--max-failures", "1", "--start-timeout-s", "5", PROBE]
    started = time.monotonic()
    result = subprocess.run(
        [*command, *PROBE_ARGS, "--output-dir", str(tmp_path / "run")],
        env=ray_head,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    took = time.monotonic() - started
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, (result.returncode, result.stderr[-3000:])
    assert "Ray found no room for 3 workers x {'CPU': 1.0} within --start-timeout-s 5, 2 times" in errors[0], errors
    assert "no checkpoint was saved" in errors[0], errors
    assert took < 120, took


def start_ray_node(space: str, veth: str, address: str, home: Path, log: Path, head: str | None = None, port=0):
    """A Ray node of 1 CPU in network namespace `space` at `address`: the head (on `port`), or joining `head`."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray_"))
    command = ["ip", "netns", "exec", space, str(BIN / "ray"), "start", "--block", "--num-cpus", "1"]
    command += ["--temp-dir", str(temp_dir), "--disable-usage-stats", "--node-ip-address", address]
    if head is None:
        command += ["--head", "--port", str(port), "--include-dashboard", "false"]
        command += ["--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port())]
    else:
        command += ["--address", head]
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": veth}
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "5"  # a drained node stops 5 s after the notice (default 30)
    node = subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: "--block" in log.read_text(), timeout=120, alive=node, what=f"the Ray node in {space}")
    return node, temp_dir


def stop_ray_node(node: subprocess.Popen, temp_dir: Path) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGKILL)
    node.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def ray_in_namespaces(machines: dict, tmp_path: Path):
    """A Ray head node of 1 CPU in namespace A; yields the drivers' environment and a function that starts node B
    (1 CPU, in namespace B, joining A) and returns its `ray start` process. Every node is stopped at the end."""
    (a, b), (veth_a, veth_b) = machines["namespaces"], machines["veths"]
    head_address, node_address = machines["address"], machines["address"].rsplit(".", 1)[0] + ".2"
    home, port = tmp_path / "home", free_port()
    nodes = [start_ray_node(a, veth_a, head_address, home, tmp_path / "head.log", port=port)]

    def start_node_b() -> subprocess.Popen:
        nodes.append(start_ray_node(b, veth_b, node_address, home, tmp_path / "b.log", head=f"{head_address}:{port}"))
        return nodes[-1][0]

    try:
        yield (
            {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": f"{head_address}:{port}"},
            start_node_b,
        )
    finally:
        for node, temp_dir in nodes:
            stop_ray_node(node, temp_dir)


@contextlib.contextmanager
def driver_in(space: str, env: dict, options: list, script_args: list, output_dir: Path, log: Path):
    """`ddp-accel ray OPTIONS tests/probe.py ... SCRIPT_ARGS` started in network namespace `space`; killed with
    its session at exit if still running."""
    command = ["ip", "netns", "exec", space, str(BIN / "ddp-accel"), "ray", *options, PROBE, *PROBE_ARGS, *script_args]
    driver = subprocess.Popen(
        [*command, "--output-dir", str(output_dir)],
        env=env,
        cwd=ROOT,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield driver
    finally:
        kill_tree(driver)


@pytest.mark.system
@pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))
def test_two_ray_nodes_a_drained_node_leaves_and_the_group_goes_on_at_world_size_1(two_machines, tmp_path):  # noqa: F811
    # node B is drained for preemption (SIGTERM to its `ray start`, what a cloud's preemption notice does): its
    # worker stops, the group restarts with the one node left (--min-workers 1) from the newest checkpoint, and
    # the run completes at world size 1 with every sample of its epochs trained
    output_dir, log = tmp_path / "run", tmp_path / "driver.log"
    with ray_in_namespaces(two_machines, tmp_path) as (env, start_node_b):
        node_b = start_node_b()
        options = ["--workers", "2", "--min-workers", "1", "--max-failures", "2", "--start-timeout-s", "20"]
        with driver_in(two_machines["namespaces"][0], env, options, ["--step-ms", "300"], output_dir, log) as driver:
            wait_for_checkpoint(output_dir, 10, timeout=240, alive=driver)
            os.kill(node_b.pid, signal.SIGTERM)  # `ray start --block` drains its node, then stops it
            wait_for(lambda: (output_dir / "preempted.json").is_file(), timeout=60, alive=driver, what="the save")
            stopped = json.loads((output_dir / "preempted.json").read_text())
            code = finish(driver, timeout=400)
    text = log.read_text()
    assert code == 0, text[-5000:]
    metrics = metrics_of(output_dir)
    assert metrics["world_size"] == 1 and metrics["end_reason"] == "completed" and metrics["resumed_from"], metrics
    assert metrics["progress"]["samples"] == 3 * 256, metrics["progress"]  # every sample of the 3 epochs
    # the notice made both ranks agree on a step and save it; the group of one resumed from that step
    assert stopped["phase"] == "train" and metrics["resumed_from"].endswith(f"step_{stopped['step']}"), (
        stopped,
        metrics,
    )
    print(f"\nresumed from {metrics['resumed_from']} at world size 1", file=sys.stderr)


@pytest.mark.system
@pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))
def test_two_ray_nodes_a_node_that_joins_grows_the_group_from_an_agreed_save(two_machines, tmp_path):  # noqa: F811
    # the group starts at world size 1 on the head node alone (--min-workers 1); node B joins after the first
    # checkpoint: Ray sees room for 2 workers at its next check (--resize-check-s), our callback has the rank save
    # the step reached before Ray ends the group, and the group of 2 resumes from that step and completes
    output_dir, log = tmp_path / "run", tmp_path / "driver.log"
    with ray_in_namespaces(two_machines, tmp_path) as (env, start_node_b):
        options = ["--workers", "2", "--min-workers", "1", "--resize-check-s", "3", "--max-failures", "1"]
        with driver_in(two_machines["namespaces"][0], env, options, ["--step-ms", "150"], output_dir, log) as driver:
            wait_for_checkpoint(output_dir, 5, timeout=240, alive=driver)
            assert "launcher                     ray (1 workers on 1 node" in log.read_text(), log.read_text()[-3000:]
            start_node_b()
            code = finish(driver, timeout=400)
    text = log.read_text()
    assert code == 0, text[-5000:]
    assert "ray: the group is resized from 1 to 2 workers: saving at an agreed step" in text, text[-5000:]
    metrics = metrics_of(output_dir)
    assert metrics["world_size"] == 2 and metrics["end_reason"] == "completed", metrics
    assert metrics["launcher"].startswith("ray (2 workers on 2 nodes"), metrics["launcher"]
    assert metrics["progress"]["samples"] == 3 * 256, metrics["progress"]  # every sample of the 3 epochs, once
    # the rank saved the step it reached on the resize (not a periodic checkpoint), and the group of 2 resumed there
    saved = re.findall(r"preempted by SIGTERM at step (\d+)", text)
    assert len(saved) == 1 and metrics["resumed_from"].endswith(f"step_{saved[0]}"), (saved, metrics["resumed_from"])
    print(f"\nnode B joined: saved step {saved[0]} at world size 1, the group of 2 resumed from it", file=sys.stderr)


@pytest.mark.system
@pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))
def test_two_ray_nodes_a_node_that_never_returns_ends_the_run_in_bounded_time_with_one_line(two_machines, tmp_path):  # noqa: F811
    # a fixed group of 2 (no --min-workers) with a rank on each node; node B dies for good (SIGKILL of its whole
    # `ray start`, no drain): Ray restarts the group, finds no room for 2 workers, and after --max-failures starts
    # of --start-timeout-s the run ends with one line naming what is lost and what is kept, not an endless retry
    output_dir, log = tmp_path / "run", tmp_path / "driver.log"
    with ray_in_namespaces(two_machines, tmp_path) as (env, start_node_b):
        node_b = start_node_b()
        options = ["--workers", "2", "--max-failures", "1", "--start-timeout-s", "10"]
        with driver_in(two_machines["namespaces"][0], env, options, ["--step-ms", "100"], output_dir, log) as driver:
            wait_for_checkpoint(output_dir, 10, timeout=240, alive=driver)
            os.killpg(node_b.pid, signal.SIGKILL)  # the machine is gone: its raylet, its worker, all at once
            lost = time.monotonic()
            code = finish(driver, timeout=300)
            took = time.monotonic() - lost
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, (code, log.read_text()[-4000:])
    assert "Ray found no room for 2 workers x {'CPU': 1.0} within --start-timeout-s 10, 2 times" in errors[0], errors
    assert "the steps since the newest checkpoint are lost" in errors[0] and "is kept" in errors[0], errors
    assert took < 200, took
    print(f"\nnode B gone: the run ended {took:.0f} s later: {errors[0]}", file=sys.stderr)
