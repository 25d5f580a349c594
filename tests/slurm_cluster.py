"""A real SLURM cluster of two "nodes" on this host, in a temp dir: munged, slurmctld and two slurmd.

    with LocalSlurm(tmp_dir) as slurm:
        job = slurm.sbatch("slurm/train.sbatch", env={...})
        slurm.wait_state(job, "COMPLETED")

Debian 12's slurm-wlm 22.05 (built with MULTIPLE_SLURMD): two slurmd on distinct ports with NodeHostname
localhost. Everything runs as root with state, spool and logs in the temp dir; `stop()` ends every daemon.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")


def missing_binaries() -> list[str]:
    found = {name: shutil.which(name) or (Path("/usr/sbin") / name).exists() for name in SLURM_BINARIES}
    return [name for name, present in found.items() if not present]


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


class LocalSlurm:
    NODES = ("n1", "n2")

    def __init__(self, root: Path, cpus_per_node: int = 1, kill_wait_s: int = 30):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.processes: list[subprocess.Popen] = []
        self.cpus, self.kill_wait_s = cpus_per_node, kill_wait_s
        self.started_munge = False
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(self.NODES))
        memory = 1000
        nodes = "\n".join(
            f"NodeName={name} NodeHostname=localhost NodeAddr=localhost Port={port} CPUs={self.cpus} "
            f"Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory={memory} State=UNKNOWN"
            for name, port in zip(self.NODES, node_ports, strict=False)
        )
        for name in self.NODES:
            (self.root / "spool" / name).mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(exist_ok=True)
        self.conf.write_text(f"""ClusterName=ddpaccel
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
KillWait={self.kill_wait_s}
InactiveLimit=0
MinJobAge=300
SlurmdTimeout=30
SlurmctldTimeout=30
{nodes}
# jobs of `urgent` preempt jobs of `debug`, which SLURM then requeues (SIGTERM, KillWait, SIGKILL, requeue)
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes={",".join(self.NODES)} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 \
PreemptMode=REQUEUE GraceTime=30
PartitionName=urgent Nodes={",".join(self.NODES)} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
""")

    def start(self) -> LocalSlurm:
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_conf()
        self._start_munge()
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for name in self.NODES:
            self._spawn(["slurmd", "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}.out")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = self.scontrol("show", "nodes", check=False)
            if states.count("State=IDLE") == len(self.NODES):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"SLURM nodes did not become idle:\n{states}\n{self.logs()}")

    def _start_munge(self) -> None:
        """munged refuses to run as root ('Logfile is insecure'): start it as the munge user, own socket dir."""
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return  # already running on this host: left as it is
        subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "/run/munge"], check=True)
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
        self.started_munge = True
        deadline = time.monotonic() + 10
        while subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("munged did not start")
            time.sleep(0.1)

    def _spawn(self, command: list[str], log: str) -> None:
        out = open(self.root / log, "w")
        self.processes.append(
            subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )

    def stop(self) -> None:
        for job in self.squeue_ids():
            subprocess.run(["scancel", "--full", job], env=self.env, capture_output=True)
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        # job steps (slurmstepd and their tasks) outlive their slurmd when it is killed
        subprocess.run(["pkill", "-9", "-f", f"slurmstepd.*{self.root}"], capture_output=True)
        pid_file = Path("/run/munge/munged.pid")
        if self.started_munge and pid_file.is_file():
            os.kill(int(pid_file.read_text()), signal.SIGTERM)

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def scontrol(self, *args: str, check: bool = True) -> str:
        result = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True)
        if check and result.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {result.stderr}")
        return result.stdout + result.stderr

    def sbatch(self, script: str | Path | None, *options: str, env: dict | None = None, cwd: Path | None = None) -> str:
        """Submit `script` (None with a --wrap option); returns the job id."""
        command = ["sbatch", "--parsable", *options, *([str(script)] if script else [])]
        result = subprocess.run(command, env={**self.env, **(env or {})}, capture_output=True, text=True, cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def squeue_ids(self) -> list[str]:
        result = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
        return result.stdout.split()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RestartCnt, Reason, ...)."""
        text = self.scontrol("show", "job", job_id, check=False)
        fields = {}
        for token in text.split():
            key, sep, value = token.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def wait_state(self, job_id: str, *states: str, timeout: float = 240) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {self.job(job_id)}\n{self.logs()}")

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.scontrol("show", "nodes", check=False).count("State=IDLE ") < len(self.NODES):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"nodes not idle after {timeout} s:\n{self.scontrol('show', 'nodes', check=False)}"
                )
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()[-2000:]}" for path in sorted(self.root.glob("*.log")))
