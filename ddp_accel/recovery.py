"""`ddp-accel launch --recover in-process`: a lost rank costs the survivors no restart.

Under torchrun a dead rank ends every worker, and the whole group starts again: each failure pays a cold start
(the interpreter, the imports, the model's build). Here the launcher starts the processes itself and owns the store
they meet at (a TCPStore in the launcher: losing rank 0 loses no store). When a process dies:

1. Its peers' collective fails. Each survivor saves the step it reached, as it does under torchrun
   (ddp_accel.rescue), tells the launcher (its `saved` key, with the run's global batch), and raises `Regroup` up
   to run_main: its process, its imports, its forkserver and its page cache stay.
2. The launcher reaps the dead process and, once every survivor has reported, publishes the next generation: who
   its members are and each one's per-process batch. With `--exact-micro-batch M`, and a global batch the survivors
   divide into pieces of M, the survivors go on alone, each with a larger share of the same global batch (the
   gradient is a function of the global batch alone: bitwise the fault-free run's). Otherwise a replacement process
   starts for the lost rank and the group keeps its size (bitwise as the restart under torchrun is).
3. Each survivor leaves the broken group, forms the new one on a fresh store prefix (`generation_N`), and runs the
   script's main again, resuming from the step it saved.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

GENERATION = "DDP_ACCEL_RECOVERY_GENERATION"  # the group this process belongs to (0 at the launch)
SLOT = "DDP_ACCEL_RECOVERY_SLOT"  # the process's place among the launched ones (its rank at generation 0)
LAUNCHER = "DDP_ACCEL_RECOVERY_LAUNCHER"  # the launcher's pid: a worker ends with it
KEY = "ddp_accel/recovery"
REPORT_TIMEOUT_S = 120.0  # a survivor that neither reports nor ends by then is ended: the group goes on without it


def under_in_process_recovery() -> bool:
    return GENERATION in os.environ


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a survivor tells the launcher once it saved the step it reached."""

    step: int
    global_batch: int
    exact_micro_batch: int  # 0: without --exact-micro-batch

    def shares(self, processes: int) -> int | None:
        """The per-process batch with which `processes` processes keep the global batch bitwise (None: none)."""
        if not self.exact_micro_batch or self.global_batch % processes:
            return None
        share = self.global_batch // processes
        return share if share % self.exact_micro_batch == 0 else None


class Regroup(BaseException):
    """A peer was lost and the step reached is saved: leave this group and run main again in the next one. A
    BaseException, so that no `except Exception` of a script takes it for its own failure."""

    def __init__(self, facts: Facts):
        super().__init__(f"a peer was lost at step {facts.step}")
        self.facts = facts


def store_client(timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def store_prefix() -> str:
    return f"ddp_accel/generation_{os.environ[GENERATION]}"


def rejoin(facts: Facts, timeout_s: float = REPORT_TIMEOUT_S) -> None:
    """Leave the broken group, report, wait for the launcher's next generation and take its place in it: the
    launch variables (RANK, WORLD_SIZE), and the command's resume (`--resume-from-checkpoint latest`, and the
    per-process batch the launcher chose)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    from ddp_accel.errors import UserError

    if dist.is_initialized():
        group = dist.group.WORLD
        abort = getattr(group, "abort", None)  # torch's own end of a group whose peer is gone: no wait on it
        if abort is not None:
            abort()
        dist.destroy_process_group()
    # Accelerate keeps the world it was built in for the process's life; the next main builds it again. Its reset
    # is the one its own tests use (no public one).
    AcceleratorState._reset_state(reset_partial_state=True)
    generation, slot = int(os.environ[GENERATION]), os.environ[SLOT]
    store = store_client(timeout_s)
    store.set(f"{KEY}/saved_{generation}/{slot}", json.dumps(dataclasses.asdict(facts)))
    following = f"{KEY}/generation_{generation + 1}"
    try:
        store.wait([following], datetime.timedelta(seconds=timeout_s))
    except Exception:  # the store's own timeout error: the launcher chose no next group
        raise UserError(
            f"in-process recovery: the launcher formed no new group within {timeout_s:g} s of the loss at step "
            f"{facts.step}; resume with --resume-from-checkpoint latest"
        ) from None
    plan = json.loads(store.get(following))
    members: list[str] = plan["members"]
    os.environ.update(
        {
            GENERATION: str(generation + 1),
            "RANK": str(members.index(slot)),
            "LOCAL_RANK": str(members.index(slot)),
            "WORLD_SIZE": str(len(members)),
            "LOCAL_WORLD_SIZE": str(len(members)),
        }
    )
    sys.argv[1:] = resumed_arguments(sys.argv[1:], plan.get("batch_size"))


def resumed_arguments(arguments: list[str], batch_size: int | None) -> list[str]:
    """The command's arguments, resumed from the latest checkpoint, with `batch_size` a process when given (the
    last of a repeated option is the one argparse keeps)."""
    resumed = [*arguments, "--resume-from-checkpoint", "latest"]
    return [*resumed, "--batch-size", str(batch_size)] if batch_size else resumed


class Launcher:
    """Starts `processes` processes of `command` on this machine around a store of its own, and forms a new group
    after each loss (the module's docstring). Returns the command's exit status from `run`."""

    def __init__(self, command: list[str], processes: int, report_timeout_s: float = REPORT_TIMEOUT_S):
        import torch.distributed as dist

        self.command, self.processes, self.report_timeout_s = command, processes, report_timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.generation = 0
        self.members = [str(slot) for slot in range(processes)]
        self.running: dict[str, subprocess.Popen] = {}
        self.received: list[int] = []
        self.recoveries = 0

    def start(self, slot: str, resume_with: list[str] | None = None) -> None:
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "RANK": str(self.members.index(slot)),
            "LOCAL_RANK": str(self.members.index(slot)),
            "WORLD_SIZE": str(len(self.members)),
            "LOCAL_WORLD_SIZE": str(len(self.members)),
            GENERATION: str(self.generation),
            SLOT: slot,
            LAUNCHER: str(os.getpid()),
        }
        arguments = self.command[1:] if resume_with is None else resume_with
        self.running[slot] = subprocess.Popen([self.command[0], *arguments], env=env)

    def run(self) -> int:
        previous = {signum: signal.signal(signum, self.on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            for slot in self.members:
                self.start(slot)
            return self.watch()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.end_all()

    def on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def watch(self) -> int:
        forwarded, completed = 0, 0
        while self.running:
            while len(self.received) > forwarded:  # a preemption or Ctrl-C: every process saves and ends
                for process in self.running.values():
                    process.send_signal(self.received[forwarded])
                forwarded += 1
            ended = {slot: process.returncode for slot, process in self.running.items() if process.poll() is not None}
            for slot, code in ended.items():
                del self.running[slot]
                if code == 0:
                    completed += 1
                elif code < 0 and not self.received:  # killed by a signal (SIGKILL, a crash): a loss to recover
                    if not self.recover(slot, code):
                        return 1
                else:  # an error with its own line (a user error: the same at every try), or a stop
                    self.end_all()
                    return code
            time.sleep(0.05)
        return 0

    def recover(self, lost: str, code: int) -> bool:
        """The survivors' reports, then the next generation: survivors alone where they keep the global batch
        bitwise, else a replacement for `lost`. False where nobody is left to go on."""
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(code)
        print(
            f"ddp-accel launch: rank {self.members.index(lost)} (pid of slot {lost}) ended by {name}; "
            "recovering in process",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        reports: dict[str, Facts] = {}
        while True:
            for slot, process in list(self.running.items()):
                if process.poll() is not None and slot not in reports:
                    del self.running[slot]  # a second loss while the group re-forms: it goes without that one
                key = f"{KEY}/saved_{self.generation}/{slot}"
                if slot in self.running and slot not in reports and self.store.check([key]):
                    reports[slot] = Facts(**json.loads(self.store.get(key)))
            if set(reports) == set(self.running):
                break
            if time.monotonic() - started > self.report_timeout_s:
                for slot in set(self.running) - set(reports):  # alive but silent (stopped, cut off): ended
                    self.running.pop(slot).kill()
                break
            time.sleep(0.02)
        if not reports:
            print("error: in-process recovery: no process survived to go on", file=sys.stderr, flush=True)
            return False
        facts = next(iter(reports.values()))
        survivors = sorted(reports, key=int)
        share = facts.shares(len(survivors))
        self.generation += 1
        self.recoveries += 1
        if share is not None:
            self.members = survivors
            how = f"{len(survivors)} survivors go on at step {facts.step}, {share} samples each"
        else:
            replacements = [slot for slot in self.members if slot not in reports]
            how = f"{len(replacements)} replacement(s) join the {len(survivors)} survivors at step {facts.step}"
        plan = {"members": self.members, "batch_size": share}
        self.store.set(f"{KEY}/generation_{self.generation}", json.dumps(plan))
        if share is None:
            for slot in replacements:
                self.start(slot, resume_with=resumed_arguments(self.command[1:], None))
        print(f"ddp-accel launch: generation {self.generation}: {how}", file=sys.stderr, flush=True)
        return True

    def end_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        for process in self.running.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.running.clear()


def launch(script_command: list[str], processes: int) -> int:
    """`ddp-accel launch --recover in-process`: `script_command` (the script and its arguments) on `processes`
    processes of this machine."""
    return Launcher([sys.executable, *script_command], processes).run()
