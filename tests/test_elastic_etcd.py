"""The torchelastic + etcd recipe for real: a private etcd (v2 API) on a free loopback port, 2 nodes joining
through `torchrun --rdzv_backend etcd-v2`, and a membership change with `--rdzv_backend etcd` (a node joins a
running job, then one leaves). Skips when the etcd binary or python-etcd is missing (.ci/run
installs Debian's etcd-server and PyPI's python-etcd)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import BIN, ROOT, checkpoint_steps, free_port, kill_tree, metrics_of, start_node, wait_for, wait_nodes

ETCD = shutil.which("etcd")


@pytest.fixture
def etcd_endpoint(tmp_path):
    if ETCD is None:
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    pytest.importorskip("etcd", reason="python-etcd is not installed")
    client, peer = free_port(), free_port()
    server = subprocess.Popen(
        [
            ETCD,
            "--enable-v2",
            "--name",
            "test",
            "--data-dir",
            str(tmp_path / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{client}/version", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError("etcd did not start") from None
                time.sleep(0.2)
        yield f"127.0.0.1:{client}"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.system
def test_two_nodes_rendezvous_through_etcd(tmp_path, etcd_endpoint):
    command = [
        str(BIN / "torchrun"),
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "etcd-v2",
        "--rdzv_endpoint",
        etcd_endpoint,
        "--rdzv_id",
        "ddp-accel-test",
        "scripts/minimal.py",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    outputs = wait_nodes([start_node(command) for _ in range(2)])
    ranks = sorted(
        int(rank) for out in outputs for rank in re.findall(r"^rank (\d+) local_rank 0 world_size 2", out, re.M)
    )
    assert ranks == [0, 1], outputs


def elastic_agent(endpoint: str, rdzv_id: str, output_dir, train_size: int, step_ms: int) -> list[str]:
    """One torchrun agent of an elastic job (1 to 2 nodes, etcd rendezvous) running tests/probe.py: batch 4, 2 epochs,
    a checkpoint every 10 steps, resuming the newest."""
    command = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "etcd"]
    command += ["--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id, "--max_restarts", "3"]
    command += ["--rdzv_conf", "last_call_timeout=2", "--monitor_interval", "1", str(ROOT / "tests" / "probe.py")]
    command += ["--output-dir", str(output_dir), "--batch-size", "4", "--epochs", "2", "--train-size", str(train_size)]
    command += ["--step-ms", str(step_ms), "--dropout", "0", "--checkpointing-steps", "10"]
    return [*command, "--resume-from-checkpoint", "latest"]


def agent_log(path) -> str:
    return path.read_text() if path.is_file() else ""


@pytest.mark.system
def test_a_node_joins_then_one_leaves_and_the_run_goes_on(tmp_path, etcd_endpoint):
    """torchelastic's etcd rendezvous (the seeds' recipe): agent A trains alone; agent B joins, A's worker saves the
    step reached and both continue at world size 2 from it; then B is stopped (SIGTERM), its worker saves, A's worker
    (stopped only by its peer) exits non-zero so that agent A forms the group again alone, and it finishes at world
    size 1. Both agents of the join exit 0 when the run ends; the one stopped by SIGTERM exits with torch's status."""
    output_dir = tmp_path / "out"
    command = elastic_agent(etcd_endpoint, "join-leave", output_dir, train_size=1024, step_ms=30)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / "agent_a.log", tmp_path / "agent_b.log"]
    start = [
        lambda i=i: subprocess.Popen(
            command, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        for i in (0, 1)
    ]
    a = start[0]()
    try:
        wait_for(lambda: checkpoint_steps(output_dir), timeout=120, alive=a, what="agent A training alone")
        b = start[1]()
        try:
            # the group forms again with both: every rank resumes at world size 2
            wait_for(lambda: agent_log(logs[1]).count("resumed from") >= 1, timeout=180, alive=b, what="B to join")
            joined = agent_log(logs[0])
            assert "preempted by SIGTERM" in joined, joined[-3000:]  # A's worker saved the step reached
            both = lambda: agent_log(logs[0]) + agent_log(logs[1])  # noqa: E731 (rank 0, whose banner it is, may be B)
            assert re.search(r"world_size\s+2\b", both()), both()[-3000:]
            before = set(checkpoint_steps(output_dir))  # then a checkpoint written at world size 2
            wait_for(
                lambda: set(checkpoint_steps(output_dir)) - before,
                timeout=120,
                alive=b,
                what="training at world size 2",
            )
            # B must leave while the run has steps left (A trains alone while B starts: B starts at A's first
            # checkpoint, step 10)
            assert not (output_dir / "metrics.json").exists(), "the run finished before node B could leave"
            b.send_signal(signal.SIGTERM)  # node B leaves
            b.wait(timeout=120)
        finally:
            kill_tree(b)
        assert a.wait(timeout=300) == 0, agent_log(logs[0])[-4000:]
    finally:
        kill_tree(a)
    text = agent_log(logs[0])
    metrics = metrics_of(output_dir)
    assert metrics["world_size"] == 1 and not (output_dir / "preempted.json").exists()
    resumed = re.findall(r"resumed from \S+: step (\d+)", text)
    assert len(resumed) >= 2, text[-4000:]  # after the join (world size 2), after the leave (world size 1)
    print(
        f"\njoin: A saved and both resumed from step {resumed[0]} at world size 2; leave: A resumed alone from step "
        f"{resumed[-1]} and finished at {metrics['steps']} steps (world size 1)",
        file=sys.stderr,
    )


@pytest.mark.system
def test_a_node_that_joins_in_the_second_half_of_a_run_finishes_it(tmp_path, etcd_endpoint):
    """Agent A trains alone (batch 4: 256 steps); B joins once A's checkpoints are past the middle of the run (chosen
    from its progress, not a sleep). At world size 2 the run has 128 steps and the place reached is past step 64:
    comparing step numbers of different global batches refused this resume and ended both agents."""
    output_dir = tmp_path / "out"
    command = elastic_agent(etcd_endpoint, "join-late", output_dir, train_size=512, step_ms=100)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / "agent_a.log", tmp_path / "agent_b.log"]
    agents = []
    try:
        for log in logs:
            agents.append(
                subprocess.Popen(
                    command, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
                )
            )
            if len(agents) == 1:  # B starts once A alone is past the middle: step 128 of 256
                wait_for(
                    lambda: max(checkpoint_steps(output_dir), default=0) > 128,
                    timeout=180,
                    alive=agents[0],
                    what="agent A past the middle of the run",
                )
        for agent, log in zip(agents, logs, strict=True):
            assert agent.wait(timeout=300) == 0, agent_log(log)[-4000:]
    finally:
        for agent in agents:
            kill_tree(agent)
    text = agent_log(logs[0]) + agent_log(logs[1])
    metrics = metrics_of(output_dir)
    assert metrics["world_size"] == 2, text[-4000:]  # B joined before the end: the run finished at world size 2
    resumed = [int(step) for step in re.findall(r"resumed from \S+: step (\d+)", text)]
    assert resumed and min(resumed) > 64, text[-4000:]  # the join's place: past the middle of the 128 steps
    assert metrics["steps"] == 128 and metrics["progress"]["samples"] == 2 * 512  # the uninterrupted run's samples
    print(f"\nB joined past the middle: resumed at step {min(resumed)} of 128 (world size 2)", file=sys.stderr)
