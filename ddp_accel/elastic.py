"""What a worker tells torch elastic's agent (torchrun, accelerate launch): a user error is not to be retried, and
its message goes in the agent's failure report (`report_to_launcher`); and this process's rank (`process_rank`).

torch elastic restarts a failed worker group up to `--max_restarts` times, whatever the cause: a mistyped option,
missing data, a checkpoint of another run or a loss that turns nan at the same step fail the same way each time (a
typo cost 4 attempts and 49 s with `--max_restarts 3`). The agent has no exit code for "do not retry"; a worker can
stop it, though: SIGTERM to the agent makes it end its workers and exit at once, without another attempt (it prints
torch's `SignalException: Process N got signal: 15` after our error line). Crashes still restart.

A worker also ends with its agent (`end_with_the_launcher`): torch starts each worker in a session of its own, so
a launcher killed outright (SIGKILL, `kill -9 -- -PGID` of a stuck job) would leave its ranks training on, holding
the output dir.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from ddp_accel import launch_environments, recovery

# the processes that run torch elastic's agent in-process, by their command line
AGENT_COMMANDS = ("torchrun", "torch.distributed.run", "torch/distributed/run.py", "accelerate")


def restarts_left() -> int:
    """The restarts torch elastic's agent has left for this worker group (0 outside torch elastic)."""
    try:
        return int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) - int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    except (KeyError, ValueError):
        return 0


START_TIME = 19  # in stat_fields (field 22 of /proc/PID/stat): when the process started, in clock ticks


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first, then the parent): the name may hold
    spaces and parentheses. OSError when the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def child_processes(parent: int) -> Iterator[tuple[list[str], bytes]]:
    """Each process whose parent is `parent`: its `stat_fields` and its raw command line (NUL-separated)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = stat_fields(entry.name)
            if int(fields[1]) != parent:
                continue
            command = Path(entry.path, "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        yield fields, command


def agent_pid() -> int | None:
    """This worker's agent: its parent, when the parent runs torch elastic (not a shell, srun or a notebook)."""
    launcher = os.environ.get(recovery.LAUNCHER)  # ddp-accel launch --recover in-process
    if launcher is not None and launcher == str(os.getppid()):
        return os.getppid()
    command = " ".join(launch_environments.parent_command())
    return os.getppid() if any(name in command for name in AGENT_COMMANDS) else None


def end_with_the_launcher(poll_s: float = 0.5) -> threading.Event | None:
    """Under torch elastic's agent, watch it: once it is gone (this process was given another parent), this one
    stops as a SIGTERM stops it (the ranks agree on a step, save it and exit; the same command resumes there).
    Returns the event that ends the watch (None: not under an agent)."""
    agent = agent_pid()
    if agent is None:
        return None
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            if os.getppid() != agent:
                print(
                    f"warning: rank {process_rank()}: its launcher (pid {agent}) is gone; stopping at the next step "
                    "with a checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="ddp_accel-launcher-watch", daemon=True).start()
    return done


def wait_for_a_stop_signal(seconds: float) -> bool:
    """Wait up to `seconds`; True as soon as this process received a stop signal (its launcher is ending it)."""
    from ddp_accel.stopping import StopSignals

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if StopSignals.current is not None and StopSignals.current.received:
            return True
        time.sleep(0.05)
    return False


def stop_restarts() -> bool:
    """After a user error's line is out: stop this node's agent, so that it does not start the group again. The
    local main process tells it; another process only when the error is its alone (the agent, once told, ends it
    within that wait). Returns whether the agent was told."""
    if restarts_left() <= 0 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if int(os.environ.get("LOCAL_RANK", "0") or 0) != 0 and wait_for_a_stop_signal(3.0):
        return False  # the agent, told by the local main process, is ending this one
    agent = agent_pid()
    if agent is None:
        return False
    try:
        os.kill(agent, signal.SIGTERM)
    except OSError:
        return False
    return True


def process_rank() -> int:
    """This process's rank: the process group's, else the launcher's (RANK, only with a WORLD_SIZE above 1: a stray
    RANK in a shell must not silence a lone process's errors)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            return int(os.environ.get("RANK", "0") or 0)
    except ValueError:  # inconsistent launcher variables: check_launch_environment says so, from every process
        pass
    return 0


def report_to_launcher(message: str) -> None:
    """torch elastic (torchrun, accelerate launch) prints a failed worker's error file in its failure report; a
    plain-string message is shown as is, instead of 'To enable traceback see ...'."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as file:
            json.dump({"message": message, "timestamp": str(int(time.time()))}, file)
