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

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    BIN,
    ROOT,
    STANDARD_PROBE_ARGS,
    checkpoint_steps,
    free_port,
    metrics_of,
    wait_for,
    wait_for_checkpoint,
    weights,
)
from test_two_machines import namespaces_available, two_machines  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))

MANIFEST = ROOT / "kubernetes" / "pytorchjob.yaml"
ELASTIC_MANIFEST = ROOT / "kubernetes" / "pytorchjob-elastic.yaml"
ETCD = shutil.which("etcd")
PROBE_ARGS = [*STANDARD_PROBE_ARGS, "--step-ms", "30"]


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
    args = [re.sub(r"\$\((\w+)\)", lambda name: env[name.group(1)], arg) for arg in container["args"]]
    launcher_options = [arg for arg in args[: next(i for i, a in enumerate(args) if not a.startswith("--"))]]
    command = [str(BIN / container["command"][0]), *launcher_options, str(ROOT / "tests" / "probe.py")]
    return [*command, *PROBE_ARGS, "--output-dir", str(output_dir), "--resume-from-checkpoint", "latest"]


def start_pod(machines: dict, index: int, container: dict, env: dict, command: list, log: Path, **emulation: str):
    """One pod: `command` in network namespace `index` with the container's environment, the operator's (`env`)
    over it, and what the emulation adds: the link gloo must use (a pod's host name resolves to its address;
    here to loopback), and `emulation`'s variables."""
    container_env = {item["name"]: item["value"] for item in container.get("env", [])}
    full_env = {**os.environ, **container_env, **env, "OMP_NUM_THREADS": "1"}
    full_env |= {"GLOO_SOCKET_IFNAME": machines["veths"][index], **emulation}
    return subprocess.Popen(
        ["ip", "netns", "exec", machines["namespaces"][index], *command],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=full_env,
        start_new_session=True,
    )


def start_pods(job: dict, machines: dict, output_dir: Path, logs: list[Path]) -> list[subprocess.Popen]:
    port = free_port()
    pods = []
    for rank, (replica_type, index) in enumerate((("Master", 0), ("Worker", 0))):
        spec = job["spec"]["pytorchReplicaSpecs"][replica_type]["template"]["spec"]
        container = spec["containers"][0]
        env = operator_environment(job, replica_type, index, machines["address"])
        env["MASTER_PORT"] = str(port)  # a free port on this shared host
        pods.append(start_pod(machines, rank, container, env, pod_command(container, env, output_dir), logs[rank]))
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
def test_a_pytorchjob_pod_deleted_mid_training_restarts_and_ends_bitwise(
    two_machines,  # noqa: F811
    tmp_path,
    standard_reference,
):
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

    a, b = weights(standard_reference), weights(output_dir)  # the same job on one host, uninterrupted
    assert all(torch.equal(a[key], b[key]) for key in a), "weights differ from the uninterrupted run"
    saved = " ".join(marker.split())
    print(f"\npod deleted after step 5: both pods ended {stopped_s:.1f} s later; {saved}", file=sys.stderr)


# --- the elastic variant: kubernetes/pytorchjob-elastic.yaml ---
def elastic_environment(job: dict, rdzv_address: str) -> dict[str, str]:
    """What setPodEnv gives each worker pod of an elastic PyTorchJob without a Master (envvar.go, and elastic.go's
    ElasticEnvVarGenerator): the rendezvous, the range of pods, the restarts; no MASTER_ADDR, RANK or WORLD_SIZE."""
    policy = job["spec"]["elasticPolicy"]
    return {
        "PYTHONUNBUFFERED": "0",
        "PET_RDZV_ENDPOINT": f"{rdzv_address}:{policy['rdzvPort']}",  # a cluster: f"{policy['rdzvHost']}:{port}"
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": str(policy["nProcPerNode"]),
        "PET_RDZV_ID": policy["rdzvId"],
        "PET_RDZV_CONF": ",".join(f"{conf['key']}={conf['value']}" for conf in policy["rdzvConf"]),
    }


@contextlib.contextmanager
def etcd_in(space: str, address: str, port: int, data_dir: Path):
    """etcd with its v2 API in network namespace `space`, on `address`: what the manifest's etcd Service gives."""
    url = f"http://{address}:{port}"
    command = ["ip", "netns", "exec", space, str(ETCD), "--enable-v2", "--name", "rdzv", "--data-dir", str(data_dir)]
    command += ["--listen-client-urls", url, "--advertise-client-urls", url]
    command += ["--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380"]
    command += ["--initial-cluster", "rdzv=http://127.0.0.1:2380"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    probe = ["ip", "netns", "exec", space, sys.executable, "-c"]
    probe += [f"import urllib.request; urllib.request.urlopen('{url}/version', timeout=1)"]
    try:
        wait_for(
            lambda: subprocess.run(probe, capture_output=True).returncode == 0, timeout=60, alive=server, what="etcd"
        )
        yield
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def start_elastic_pod(job: dict, machines: dict, index: int, output_dir: Path, log: Path) -> subprocess.Popen:
    spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = spec["containers"][0]
    env = elastic_environment(job, machines["address"])
    command = pod_command(container, env, output_dir)
    command[command.index("--step-ms") + 1] = "50"  # long enough for a pod to leave and come back
    command[command.index("--train-size") + 1] = "512"
    # in a pod the host name resolves to the pod's address; here both namespaces share one host name: say it
    address = machines["address"].rsplit(".", 1)[0] + f".{index + 1}"
    return start_pod(machines, index, container, env, command, log, PET_LOCAL_ADDR=address)


@pytest.mark.system
@pytest.mark.skipif(ETCD is None, reason="no etcd binary (apt-get install etcd-server)")
def test_an_elastic_pytorchjob_goes_on_without_a_deleted_pod_and_grows_back_when_it_returns(two_machines, tmp_path):  # noqa: F811
    # worker-1's pod is deleted after step 5's checkpoint (the kubelet's SIGTERM to its torchrun): every rank saves
    # the step reached, worker-0 goes on alone at world size 1; then the operator creates the pod again: the group
    # grows back to 2 from the step reached then, and the run completes with every sample of its epochs trained
    pytest.importorskip("etcd", reason="python-etcd is not installed (.ci/run installs it)")
    documents = list(yaml.safe_load_all(ELASTIC_MANIFEST.read_text()))
    job = next(document for document in documents if document["kind"] == "PyTorchJob")
    service = next(document for document in documents if document["kind"] == "Service")
    policy = job["spec"]["elasticPolicy"]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"} and policy["rdzvBackend"] == "etcd"
    assert (
        service["metadata"]["name"] == policy["rdzvHost"] and service["spec"]["ports"][0]["port"] == policy["rdzvPort"]
    )
    grace = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"]
    output_dir = tmp_path / "run"
    logs = [tmp_path / "worker0.log", tmp_path / "worker1.log", tmp_path / "worker1_again.log"]
    space = two_machines["namespaces"][0]
    with etcd_in(space, two_machines["address"], policy["rdzvPort"], tmp_path / "etcd"):
        pods = [start_elastic_pod(job, two_machines, index, output_dir, logs[index]) for index in (0, 1)]
        try:
            wait_for_checkpoint(output_dir, 5, timeout=180, alive=pods[0])
            assert re.search(r"world_size\s+2\b", logs[0].read_text() + logs[1].read_text())
            deleted = time.monotonic()
            os.kill(pods[1].pid, signal.SIGTERM)  # the kubelet deletes worker-1's pod
            pods[1].wait(timeout=grace)
            left_s = time.monotonic() - deleted
            stopped = (output_dir / "preempted.json").read_text()
            # worker-0 alone: resumed at world size 1, and a checkpoint written there
            wait_for(lambda: "resumed from" in logs[0].read_text(), timeout=120, alive=pods[0], what="worker-0 alone")
            alone = set(checkpoint_steps(output_dir))
            wait_for(
                lambda: set(checkpoint_steps(output_dir)) - alone,
                timeout=120,
                alive=pods[0],
                what="a checkpoint at world size 1",
            )
            assert not (output_dir / "metrics.json").exists(), "the run ended before the pod could come back"
            pods.append(start_elastic_pod(job, two_machines, 1, output_dir, logs[2]))  # the operator recreates it
            codes = [pods[0].wait(timeout=300), pods[2].wait(timeout=60)]
        finally:
            for pod in pods:
                if pod.poll() is None:
                    os.killpg(pod.pid, signal.SIGKILL)
                    pod.wait()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], (codes, texts[0][-3000:], texts[2][-3000:])
    assert left_s < grace and '"signal": "SIGTERM"' in stopped, (left_s, stopped)
    metrics = metrics_of(output_dir)
    assert metrics["end_reason"] == "completed" and metrics["world_size"] == 2, metrics
    assert metrics["progress"]["samples"] == 3 * 512, metrics["progress"]  # every sample of the 3 epochs
    resumed = re.findall(r"resumed from \S+: step (\d+)", texts[0] + texts[2])  # rank 0's: either pod's
    assert len(resumed) >= 2, (resumed, texts[0][-3000:], texts[2][-3000:])  # alone, then grown back
    print(
        f"\npod left after step 5 ({left_s:.1f} s); worker-0 resumed alone from step {resumed[0]}, the group of 2 "
        f"from step {resumed[-1]}; {metrics['steps']} steps in all",
        file=sys.stderr,
    )
