"""Where a process was started from, as one typed adapter per environment (Lightning's `ClusterEnvironment` is the
model): a lone process, an env:// launch (srun tasks, mp.spawn, a shell that exported the variables), torch elastic
(torchrun, accelerate launch), and Ray Train (`ddp-accel ray`). Each answers the same questions: this process's
rank and the world size, how often the group was restarted, where its stop signals come from, whether every
machine runs the same number of processes, the banner's line, what it says while its group forms; and checks that
its launcher's variables describe one job (`check`). SLURM and Kubernetes are the scheduler around a launcher
(`scheduler`): they decide who is signalled at a preemption and how a job is requeued.

`current()` is this process's launch environment, read from its environment; a launcher that runs the script inside its
own process (Ray's worker, the Ray driver's option check) says so with `use(environment)`, not through a variable.

A run's result comes back the same way: `run_main` records an `Outcome` (completed, preempted, a user error, a
crash) that a launcher in the same process reads with `last_outcome()`, instead of files in the output dir.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_accel.errors import UserError


def _scheduler(env: Mapping[str, str]) -> str | None:
    if env.get("SLURM_JOB_ID"):
        return "slurm"
    if env.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    return None


def _number(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, "") or default)
    except ValueError:
        return default


def is_accelerate_launch(command: list[str]) -> bool:
    """Whether a command line is `accelerate launch` (`accelerate-launch`, `python -m accelerate.commands.launch`)."""
    names = [Path(part).name for part in command]
    return (
        ("accelerate" in names and "launch" in command)
        or "accelerate-launch" in names
        or any(part.endswith("accelerate.commands.launch") for part in command)
    )


def parent_command() -> list[str]:
    """The parent process's command line (empty when it cannot be read)."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@dataclass(frozen=True)
class LaunchEnvironment:
    """A lone process: rank 0 of 1, never restarted by a launcher."""

    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    name = "process"

    @property
    def scheduler(self) -> str | None:
        return _scheduler(self.env)

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def restarts(self) -> int:
        """How often this job was started again before this attempt (a launcher's restarts, a scheduler's requeues)."""
        return _number(self.env, "SLURM_RESTART_COUNT", 0)

    @property
    def even_placement(self) -> bool:
        """Every machine runs the same number of processes (torch's launchers); Ray places them as resources allow."""
        return True

    def stop_signals(self) -> str:
        """Who sends this process its preemption signal."""
        if self.scheduler == "slurm":
            return "SLURM signals every process of the job step"
        if self.scheduler == "kubernetes":
            return "Kubernetes sends SIGTERM to the pod's first process only"
        return "the user or the system, to this process"

    def banner(self) -> str | None:
        """The banner's `launcher` line, for a launch environment that is not torch's own launch."""
        return None

    def checks_only(self) -> bool:
        """make_accelerator stops once the options are checked (a launcher's driver runs the script that far)."""
        return False

    @property
    def outlives_the_script(self) -> bool:
        """The process goes on after the script (a launcher runs the script in its own process): the forkserver and
        the resource tracker are the process's, not the script's, to end."""
        return False

    @property
    def forms_its_own_group(self) -> bool:
        """The processes meet by themselves (torch's env:// rendezvous), not through a launcher's agent that met the
        other machines before it started this process."""
        return False

    def waiting_line(self, waited_s: float, timeout_s: float) -> str | None:
        """What this process says while its process group has not formed after `waited_s` (None: nothing to say)."""
        return None

    def store_to_reach(self) -> tuple[str, int] | None:
        """Where this process's rendezvous connects to a store another process serves (env://, rank > 0): waited for
        before torch connects, whose failed connect prints its C++ frames; None where nothing is to be reached."""
        return None

    def never_formed_line(self, timeout_s: float) -> str:
        """The error of a process whose group did not form within --timeout-s."""
        return f"the process group did not form within --timeout-s {timeout_s:g}"

    def peer_failed(self) -> bool:
        """Another process of this job already reported its failure to the launcher: a stop signal now is the
        launcher ending the rest of the group, not a preemption (no marker: a job script would requeue the failure)."""
        return False

    def check(self) -> None:
        """The launcher variables this process started with describe one job: mistakes here otherwise end in a
        hang, a traceback deep in torch, or N duplicate trainings into one folder."""
        env = self.env
        tasks = env.get("SLURM_STEP_NUM_TASKS", "1")
        step_tasks = int(tasks or 1) if tasks.isdigit() else 1
        if step_tasks > 1 and "TORCHELASTIC_RUN_ID" not in env:
            raise UserError(
                f"SLURM started {step_tasks} tasks of this script without a launcher: each would train alone, into "
                "one folder. Start one launcher per node (srun --ntasks-per-node=1 accelerate launch ..., as "
                "slurm/train.sbatch does), or export WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT to every task",
                every_process=True,
            )
        if "RANK" in env and ("LOCAL_RANK" in env or "MASTER_ADDR" in env):  # a launcher's variables, half of them
            raise UserError(
                f"RANK={env['RANK']} is set but WORLD_SIZE is not: set both (and MASTER_ADDR, MASTER_PORT), or unset "
                "RANK and let a launcher (accelerate launch, torchrun) set them",
                every_process=True,
            )


@dataclass(frozen=True)
class EnvLaunch(LaunchEnvironment):
    """WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT exported to every process (srun tasks, mp.spawn, a shell):
    torch's env:// rendezvous, no agent to restart the group."""

    name = "env://"

    @property
    def rank(self) -> int:
        return int(self.env.get("RANK", "0"))

    @property
    def world_size(self) -> int:
        return int(self.env.get("WORLD_SIZE", "1"))

    def check_rank(self) -> int:
        """RANK within WORLD_SIZE, both whole numbers; returns the world size."""
        env = self.env
        try:
            world_size, rank = self.world_size, self.rank
        except ValueError:
            raise UserError(
                f"WORLD_SIZE={env.get('WORLD_SIZE')!r} and RANK={env.get('RANK')!r} must be whole numbers",
                every_process=True,
            ) from None
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(
                f"RANK={rank} does not fit WORLD_SIZE={world_size}: ranks go from 0 to WORLD_SIZE - 1",
                every_process=True,
            )
        return world_size

    @property
    def forms_its_own_group(self) -> bool:
        return self.world_size > 1

    def waiting_line(self, waited_s: float, timeout_s: float) -> str | None:
        """torch's env:// rendezvous waits in silence for the whole --timeout-s: rank 0 for the others to connect to
        its port, the others for rank 0 to listen there (a peer that failed before it, a wrong MASTER_ADDR)."""
        if not self.forms_its_own_group:
            return None
        address, port = self.env.get("MASTER_ADDR", ""), self.env.get("MASTER_PORT", "")
        if self.rank == 0:
            what = f"rank 0 of {self.world_size}: waiting at {address}:{port} for the other processes to join"
        else:
            answers_there = answers(address, int(port)) if port.isdigit() else False
            there = (
                "rank 0 answers there"
                if answers_there
                else "nothing answers there yet (rank 0 not started, or elsewhere)"
            )
            what = f"rank {self.rank} of {self.world_size}: waiting for the group at {address}:{port}: {there}"
        return f"{what}; {waited_s:.0f} s so far, --timeout-s {timeout_s:g} ends the wait"

    def store_to_reach(self) -> tuple[str, int] | None:
        port = self.env.get("MASTER_PORT", "")
        if not self.forms_its_own_group or self.rank == 0 or not port.isdigit():
            return None
        return self.env.get("MASTER_ADDR", ""), int(port)

    def never_formed_line(self, timeout_s: float) -> str:
        address, port = self.env.get("MASTER_ADDR", ""), self.env.get("MASTER_PORT", "")
        if self.rank == 0:
            return (
                f"rank 0 of {self.world_size}: the process group did not form within --timeout-s {timeout_s:g}: the "
                f"other processes did not join at {address}:{port}; start every rank with the same MASTER_ADDR, "
                "MASTER_PORT and WORLD_SIZE (or a larger --timeout-s)"
            )
        there = "rank 0 answers there" if port.isdigit() and answers(address, int(port)) else "nothing answers there"
        return (
            f"rank {self.rank} of {self.world_size}: the process group did not form within --timeout-s {timeout_s:g} "
            f"at {address}:{port} ({there}); start rank 0 there, or check MASTER_ADDR and MASTER_PORT"
        )

    def check(self) -> None:
        env, world_size = self.env, self.check_rank()
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if world_size > 1 and missing:
            raise UserError(
                f"WORLD_SIZE={world_size} without {' and '.join(missing)}: an env:// launch (srun, mp.spawn) needs "
                "the address and port of rank 0 in every process",
                every_process=True,
            )


@dataclass(frozen=True)
class TorchElastic(EnvLaunch):
    """torchrun or accelerate launch: an agent per machine starts the workers, restarts the group up to
    --max_restarts times, and passes a SIGTERM it receives on to its workers (then kills them after its grace)."""

    name = "torch elastic"

    @property
    def restarts(self) -> int:
        return _number(self.env, "TORCHELASTIC_RESTART_COUNT", 0) + super().restarts

    def stop_signals(self) -> str:
        return f"{super().stop_signals()}; the agent passes a SIGTERM it receives on to its workers"

    def check(self) -> None:
        self.check_rank()  # (the agent's rendezvous gives the address of rank 0)

    def peer_failed(self) -> bool:
        """The agent gives each worker of an attempt its own error file, ATTEMPT/LOCAL_RANK/error.json; a worker
        that fails writes its line there before it exits (elastic.report_to_launcher), so before the agent ends the
        others. Another worker's file: this machine's agent is ending the group. (A peer on another machine, or one
        killed outright, writes none here: the signal then counts as a preemption.)"""
        own = self.env.get("TORCHELASTIC_ERROR_FILE", "")
        if not own or own == os.devnull:
            return False
        try:
            return any(path != Path(own) for path in Path(own).parent.parent.glob("*/error.json"))
        except OSError:
            return False

    @property
    def forms_its_own_group(self) -> bool:
        return False  # the agents met before starting the workers (ddp-accel launch speaks for that wait)


@dataclass(frozen=True)
class RayWorker(TorchElastic):
    """A worker of `ddp-accel ray` (Ray Train): Ray sets the launcher variables and makes the process group; the
    script runs in a thread of the worker, whose main thread forwards the stop signals to it."""

    name = "ray"
    workers: int = 1
    nodes: int | str = 1

    @property
    def restarts(self) -> int:
        return 0  # Ray restarts the group in new worker processes: each attempt starts from the newest checkpoint

    @property
    def even_placement(self) -> bool:
        return False

    def stop_signals(self) -> str:
        return "SIGTERM/SIGUSR1 forwarded from each worker's main thread to the training thread"

    @property
    def outlives_the_script(self) -> bool:
        return True

    def banner(self) -> str:
        nodes = self.nodes
        return f"ray ({self.workers} workers on {nodes} node{'' if nodes == 1 else 's'}; {self.stop_signals()})"


@dataclass(frozen=True)
class CheckOnly(LaunchEnvironment):
    """A launcher's driver runs the script in its own process up to its Accelerator, so that a bad option is one
    line before any worker starts (ddp_accel.ray_launch)."""

    name = "check only"

    def checks_only(self) -> bool:
        return True

    @property
    def outlives_the_script(self) -> bool:
        return True


def answers(address: str, port: int, timeout: float = 1.0) -> bool:
    """Something accepts a connection at address:port (a rank 0's store, a machine 0's agent) within `timeout`."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


_chosen: list[LaunchEnvironment] = []  # set by use(): a launcher that runs the script in this process


@contextlib.contextmanager
def use(environment: LaunchEnvironment) -> Iterator[LaunchEnvironment]:
    """Run the code inside under `environment` (instead of what the environment says)."""
    _chosen.append(environment)
    try:
        yield environment
    finally:
        _chosen.remove(environment)


def current(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """This process's environment: the one a launcher in this process chose, else the environment's."""
    if _chosen and env is None:
        return _chosen[-1]
    env = dict(os.environ if env is None else env)
    if "TORCHELASTIC_RUN_ID" in env and "WORLD_SIZE" in env:
        return TorchElastic(env)
    if "WORLD_SIZE" in env:
        return EnvLaunch(env)
    return LaunchEnvironment(env)


@dataclass
class Outcome:
    """How run_main ended a script: `kind` completed, preempted (`stop`: preempted.json's fields), user_error,
    ended_for_a_peer (the launcher ended the group after another process failed), interrupted or crashed; `code` the
    exit status; `message` the error line; `metrics` what fit committed."""

    kind: str
    code: int
    message: str | None = None
    stop: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


_outcome: list[Outcome] = []
_metrics: list[dict[str, Any]] = []


def note_metrics(metrics: dict[str, Any]) -> None:
    """fit's committed metrics (metrics.json), for the outcome of the script that ran it."""
    _metrics[:] = [metrics]


def record_outcome(outcome: Outcome) -> None:
    outcome.metrics = outcome.metrics or (_metrics[0] if _metrics else None)
    _metrics.clear()
    _outcome[:] = [outcome]


def forget_outcome() -> None:
    _outcome.clear()
    _metrics.clear()


def last_outcome() -> Outcome | None:
    """The outcome of the last script run_main ran in this process (None: none ended yet)."""
    return _outcome[0] if _outcome else None
