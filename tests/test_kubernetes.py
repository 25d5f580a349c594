"""kubernetes/pytorchjob.yaml's contract without a cluster: each "pod" is a network namespace with an address of its
own, started with exactly the environment the Kubeflow training operator gives a PyTorchJob pod and the manifest's
own command. One pod is deleted the way the kubelet does it (SIGTERM to the container's main process, torchrun),
both pods restart (restartPolicy OnFailure) with the same command, and the run ends bitwise equal to the same job
on one host.

The environment, from the operator's source (kubeflow/training-operator, pkg/controller.v1/pytorch/envvar.go
`setPodEnv` and master.go `MasterEnvVarGenerator`): PYTHONUNBUFFERED=0, MASTER_PORT (the master's
`pytorchjob-port`), MASTER_ADDR (the master's service, `<job>-master-0`), WORLD_SIZE (pods x nprocPerNode), RANK
and PET_NODE_RANK (the master 0, worker i i + 1), PET_NPROC_PER_NODE (nprocPerNode), PET_NNODES (pods). What the
emulation differs in: MASTER_ADDR is the master namespace's address (no cluster DNS here), the output dir is a
folder both namespaces see (a ReadWriteMany volume there), and GLOO_SOCKET_IFNAME names the link between the
namespaces (in a pod the host name resolves to the pod's address; here to loopback)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import BIN, ROOT, check_ok, free_port, launch, wait_for_checkpoint, weights
from test_two_machines import namespaces_available, two_machines  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))

MANIFEST = ROOT / "kubernetes" / "pytorchjob.yaml"
PROBE_ARGS = ["--batch-size", "4", "--epochs", "3", "--train-size", "256", "--dropout", "0.3"]
PROBE_ARGS += ["--checkpointing-steps", "5", "--step-ms", "30"]


def operator_environment(job: dict, replica_type: str, index: int, master_address: str) -> dict[str, str]:
    """What setPodEnv gives the pod `index` of `replica_type` (Master or Worker) of this PyTorchJob."""
    replicas = job["spec"]["pytorchReplicaSpecs"]
    total = sum(spec["replicas"] for spec in replicas.values())
    nproc = job["spec"].get("nprocPerNode", "1")
    master = replicas["Master"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in master["ports"] if p["name"] == "pytorchjob-port")
    rank = index + (1 if replica_type == "Worker" else 0)
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_PORT": str(port),
        "MASTER_ADDR": master_address,  # a cluster: f"{job['metadata']['name']}-master-0"
        "WORLD_SIZE": str(total * int(nproc)),
        "RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(total),
    }


def pod_command(container: dict, env: dict[str, str], output_dir: Path) -> list[str]:
    """The container's command with Kubernetes' $(VAR) expansion; the script and its arguments (everything from
    the first argument that is not a launcher option) replaced by tests/probe.py's."""
    args = [arg.replace("$(MASTER_ADDR)", env["MASTER_ADDR"]).replace("$(MASTER_PORT)", env["MASTER_PORT"])
            for arg in container["args"]]  # fmt: skip
    launcher_options = [arg for arg in args[: next(i for i, a in enumerate(args) if not a.startswith("--"))]]
    command = [str(BIN / container["command"][0]), *launcher_options, str(ROOT / "tests" / "probe.py")]
    return [*command, *PROBE_ARGS, "--output-dir", str(output_dir), "--resume-from-checkpoint", "latest"]


def start_pods(job: dict, machines: dict, output_dir: Path, logs: list[Path]) -> list[subprocess.Popen]:
    port = free_port()
    pods = []
    for rank, (replica_type, index) in enumerate((("Master", 0), ("Worker", 0))):
        spec = job["spec"]["pytorchReplicaSpecs"][replica_type]["template"]["spec"]
        container = spec["containers"][0]
        env = operator_environment(job, replica_type, index, machines["address"])
        env["MASTER_PORT"] = str(port)  # a free port on this shared host
        container_env = {item["name"]: item["value"] for item in container.get("env", [])}
        full_env = {**os.environ, **container_env, **env, "OMP_NUM_THREADS": "1"}
        full_env["GLOO_SOCKET_IFNAME"] = machines["veths"][rank]
        command = ["ip", "netns", "exec", machines["namespaces"][rank], *pod_command(container, env, output_dir)]
        pods.append(subprocess.Popen(command, stdout=open(logs[rank], "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=full_env, start_new_session=True))  # fmt: skip
        if rank == 0:
            time.sleep(2)  # the master's pod first, as the operator's worker pods wait for its service
    return pods


def torchrun_of(pod: subprocess.Popen) -> int:
    """The container's main process: `ip netns exec` execs into torchrun, so the pod's process is torchrun."""
    return pod.pid


def wait_all(pods: list[subprocess.Popen], timeout: float = 240) -> list[int | None]:
    codes = []
    for pod in pods:
        try:
            codes.append(pod.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            os.killpg(pod.pid, signal.SIGKILL)
            codes.append(None)
    return codes


@pytest.mark.system
def test_a_pytorchjob_pod_deleted_mid_training_restarts_and_ends_bitwise(two_machines, tmp_path):  # noqa: F811
    job = yaml.safe_load(MANIFEST.read_text())
    assert job["kind"] == "PyTorchJob" and set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    grace = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"]
    output_dir = tmp_path / "run"
    logs = [tmp_path / "master.log", tmp_path / "worker.log"]
    pods = start_pods(job, two_machines, output_dir, logs)
    try:
        wait_for_checkpoint(output_dir, 5, timeout=180, alive=pods[0])
        time.sleep(0.3)
        deleted = time.monotonic()
        os.kill(torchrun_of(pods[1]), signal.SIGTERM)  # the kubelet deletes the worker pod
        codes = wait_all(pods, timeout=grace)
        stopped_s = time.monotonic() - deleted
    finally:
        for pod in pods:
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGKILL)
    texts = [log.read_text() for log in logs]
    assert all(code not in (0, None) for code in codes), (codes, texts[0][-2000:], texts[1][-2000:])  # restarted
    assert stopped_s < grace, stopped_s  # inside the pod's grace: nothing SIGKILLed
    marker = (output_dir / "preempted.json").read_text()
    assert '"signal": "SIGTERM"' in marker and '"phase": "train"' in marker, marker

    restarted = [tmp_path / "master_restart.log", tmp_path / "worker_restart.log"]
    codes = wait_all(start_pods(job, two_machines, output_dir, restarted))
    texts = [log.read_text() for log in restarted]
    assert codes == [0, 0], (codes, texts[0][-3000:], texts[1][-3000:])
    assert "resumed from" in texts[0], texts[0][-3000:]

    reference = tmp_path / "reference"  # the same job on one host: 2 processes, the same ranks
    check_ok(launch("tests/probe.py", *PROBE_ARGS, "--output-dir", reference))
    a, b = weights(reference), weights(output_dir)
    assert all(torch.equal(a[key], b[key]) for key in a), "weights differ from the uninterrupted run"
    saved = " ".join(marker.split())
    print(f"\npod deleted after step 5: both pods ended {stopped_s:.1f} s later; {saved}", file=sys.stderr)
