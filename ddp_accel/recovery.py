"""`ddp-accel launch --recover in-process`: a lost rank costs the survivors no restart.

Under torchrun a dead rank ends every worker, and the whole group starts again: each failure pays a cold start
(the interpreter, the imports, the model's build). Here the launcher starts the processes itself and owns the store
they meet at (a TCPStore in the launcher: losing rank 0 loses no store). When a process dies:

1. Its peers' collective fails. Each survivor copies the step it reached into memory and keeps it (the models'
   and optimizers' states; the small files in a folder of its own); the first writes the step's files in the
   background (ddp_accel.rescue). It tells the launcher (its `saved` key: the step, the run's global batch, that
   it holds it) and raises `Regroup` up to run_main: its process, its imports, its forkserver and its page cache
   stay.
2. The launcher reaps the dead process and, once every survivor has reported, publishes the next generation: who
   its members are and each one's per-process batch. With `--exact-micro-batch M`, and a global batch the survivors
   divide into pieces of M, the survivors go on alone, each with a larger share of the same global batch (the
   gradient is a function of the global batch alone: bitwise the fault-free run's). Otherwise a replacement process
   starts for the lost rank and the group keeps its size (bitwise as the restart under torchrun is).
3. Each survivor leaves the broken group, forms the new one on a fresh store prefix (`generation_N`), and runs the
   script's main again, resuming from the step it saved: from its own copy, at once, where every survivor holds
   it (the plan names the step; a replacement is given a survivor's copy over the group: ddp_accel.peer_copy);
   else once the step's files are written. The members
   first meet at a count of the launcher's store (`meet`): a loss before the group formed makes the launcher give
   that generation up, and whoever waits for it reports again instead of waiting on a dead peer inside torch's
   rendezvous.
4. A process alive but cut off (a deadlock, a wait in the kernel) fails no peer's call until their collective
   times out (`--timeout-s`): then the peers save and report as above while every process still runs, and the
   launcher ends the one that stays silent (`--stopped-timeout-s`) and recovers from it as from a loss.
5. Where the survivors went on alone, a replacement starts meanwhile. Once it waits at the group's door (its
   imports done), the launcher asks the survivors to hand its share back: a preemption signal, on which every
   process stops at the same step (ddp_accel.stopping) and keeps its copy of it, process 0 writing it in the
   background (ddp_accel.rescue; else every process saves it at once, as a preemption's); then all of them, the
   replacement with them, form the next generation with the first one's per-process batch and resume there.
6. With `--spares N` the launcher starts N processes besides the group's (on GPUs, each with a GPU of its own),
   which import and wait to be called. A replacement is then a spare whose imports are done, called in at once into
   the lost process's slot instead of a process started after the loss; another spare starts in its place (on the
   lost process's GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GENERATION = "DDP_ACCEL_RECOVERY_GENERATION"  # the group this process belongs to (0 at the launch)
SLOT = "DDP_ACCEL_RECOVERY_SLOT"  # the process's place among the launched ones (its rank at generation 0)
LAUNCHER = "DDP_ACCEL_RECOVERY_LAUNCHER"  # the launcher's pid: a worker ends with it
LOST_AT = "DDP_ACCEL_RECOVERY_LOST_AT"  # when the launcher saw the loss this generation recovers from
CALLED_AT = "DDP_ACCEL_RECOVERY_CALLED_AT"  # when the launcher called this generation's replacements in (hand_back)
JOINS = "DDP_ACCEL_RECOVERY_JOINS"  # a replacement: it waits to be called into a generation (the value: its start)
HELD_STEP = "DDP_ACCEL_RECOVERY_HELD_STEP"  # the step the group's survivors hold in memory: no file of it read
SPARE = "spare"  # a spare's slot until it is called into a lost process's
HAND_BACK_SIGNAL = signal.SIGUSR1  # the survivors stop together at a step for their replacements (a preemption's)
KEY = "ddp_accel/recovery"
REPORT_TIMEOUT_S = 300.0  # a survivor that neither reports nor ends by then is ended: the group goes on without it
STOPPED_TIMEOUT_S = 30.0  # a process stopped this long (SIGSTOP), or silent once its peers reported, is ended
UNUSED_TAG = 7_777_777  # close_the_connections' receive: a tag no message of the group carries
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)  # to every process: a stop saves and ends


def under_in_process_recovery() -> bool:
    return GENERATION in os.environ


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a survivor tells the launcher once it saved the step it reached."""

    step: int
    global_batch: int
    exact_micro_batch: int  # 0: without --exact-micro-batch
    held: bool = False  # it holds the step in memory (its next group needs no file of it)

    def shares(self, processes: int) -> int | None:
        """The per-process batch with which `processes` processes keep the global batch bitwise (None: none)."""
        if not self.exact_micro_batch or self.global_batch % processes:
            return None
        share = self.global_batch // processes
        return share if share % self.exact_micro_batch == 0 else None


class Regroup(BaseException):
    """A peer was lost and the step reached is saved: leave this group and run main again in the next one. A
    BaseException, so that no `except Exception` of a script takes it for its own failure."""

    def __init__(self, facts: Facts | None):
        super().__init__(
            f"a peer was lost at step {facts.step}" if facts else "a peer was lost before the group formed"
        )
        self.facts = facts  # None: lost before this group trained (the step saved stays the last one reported)


def store_client(timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def launch_variables(rank: int, world: int) -> dict[str, str]:
    """A process's place in a group of this machine, as a launcher gives it."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}


def waited(store: Any, key: str, timeout_s: float, missing: str) -> str:
    """`key`'s value once the launcher set it; `missing` as a UserError when it did not within `timeout_s`."""
    from ddp_accel.errors import UserError

    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception:  # the store's own timeout error, or the launcher gone
        raise UserError(f"in-process recovery: {missing}") from None
    return store.get(key).decode()


def store_prefix() -> str:
    return f"ddp_accel/generation_{os.environ[GENERATION]}"


def meet(timeout_s: float) -> None:
    """Before this generation's group forms: wait until all its members arrived, or the launcher gave it up (a
    process lost meanwhile: torch's rendezvous would wait for it until its timeout) and `Regroup`."""
    from ddp_accel.errors import UserError

    store, generation, world = store_client(timeout_s), os.environ[GENERATION], int(os.environ["WORLD_SIZE"])
    count, abandoned = f"{KEY}/arrived_{generation}", f"{KEY}/abandoned_{generation}"
    arrived, deadline = store.add(count, 1), time.monotonic() + timeout_s
    while arrived < world and not store.check([abandoned]):
        if time.monotonic() > deadline:
            raise UserError(
                f"in-process recovery: generation {generation}'s group did not form within {timeout_s:g} s "
                f"({arrived} of its {world} processes arrived)"
            )
        time.sleep(0.02)
        arrived = store.add(count, 0)
    if store.check([abandoned]):
        raise Regroup(None)


READERS: dict[tuple[str, str], Any] = {}  # the launcher's store (address, port) -> a client kept for launcher_set


def launcher_set(name: str) -> bool:
    """Whether the launcher set its key `name` for this process's generation (False: not set, or the launcher and
    its store are gone). One client kept: the ordered sum's waits read it every 0.1 s."""
    if not under_in_process_recovery():
        return False
    where = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    try:
        reader = READERS.get(where) or READERS.setdefault(where, store_client(5))
        return bool(reader.check([f"{KEY}/{name}_{os.environ[GENERATION]}"]))
    except Exception:
        READERS.pop(where, None)
        return False


def given_up() -> bool:
    """Whether the launcher gave this process's generation up (a member lost before the group formed)."""
    return launcher_set("abandoned")


def hand_back_asked() -> bool:
    """Whether the launcher asked this process's group to stop for its replacements (else a stop is a stop)."""
    return launcher_set("hand_back")


def wait_to_be_called(timeout_s: float) -> None:
    """A replacement, or a spare, its imports done: say so, and wait until the launcher calls it into a generation
    (its place in it: the launch variables; a spare's slot: the lost process's)."""
    if os.getppid() != int(os.environ[LAUNCHER]):  # (its launcher gone: nobody to call it)
        raise SystemExit(0)
    store, start = store_client(timeout_s), os.environ[JOINS]
    store.set(f"{KEY}/ready/{start}", "1")
    if os.environ[SLOT] == SPARE:
        wait_as_a_spare(store, f"{KEY}/called/{start}")
    call = json.loads(
        waited(store, f"{KEY}/called/{start}", timeout_s, f"this replacement was not called within {timeout_s:g} s")
    )
    os.environ[SLOT] = call["slot"]
    take_place(call["generation"], json.loads(store.get(f"{KEY}/generation_{call['generation']}")))
    del os.environ[JOINS]


def wait_as_a_spare(store: Any, key: str) -> None:
    """A spare waits for its call as long as its launcher lives, and ends quietly with it (nothing to save)."""
    while True:
        with contextlib.suppress(Exception):  # (a second without the call, or the store gone with the launcher)
            store.wait([key], datetime.timedelta(seconds=1))
            return
        if os.getppid() != int(os.environ[LAUNCHER]):
            raise SystemExit(0)


def say_completed() -> None:
    """Rank 0 ended its run whole (the outputs written): a loss the launcher sees after this is no failure."""
    if under_in_process_recovery() and os.environ.get("RANK") == "0":
        with contextlib.suppress(Exception):  # the launcher gone: nobody to tell
            store_client(5).set(f"{KEY}/completed_{os.environ[GENERATION]}", "1")


def say_the_first_step() -> None:
    """At a recovered generation's first completed step, process 0 says how long after the loss (or after the
    launcher's call for its replacements) it came."""
    for variable, what in ((LOST_AT, "the loss"), (CALLED_AT, "the call for its replacements")):
        at = os.environ.pop(variable, None)
        if at is not None and os.environ.get("RANK") == "0":
            seconds, generation = time.time() - float(at), os.environ[GENERATION]
            line = f"ddp-accel: generation {generation}'s first step done {seconds:.2f} s after {what}"
            print(line, file=sys.stderr, flush=True)


def take_place(generation: int, plan: dict[str, Any]) -> None:
    members: list[str] = plan["members"]
    rank = members.index(os.environ[SLOT])
    for earlier in (LOST_AT, CALLED_AT):  # (an earlier generation's, whose first step never came)
        os.environ.pop(earlier, None)
    if plan.get("lost_at"):
        os.environ[LOST_AT] = str(plan["lost_at"])
    if plan.get("called_at"):
        os.environ[CALLED_AT] = str(plan["called_at"])
    os.environ.pop(HELD_STEP, None)
    if plan.get("held") is not None:
        os.environ[HELD_STEP] = str(plan["held"])
    os.environ.update({GENERATION: str(generation), **launch_variables(rank, len(members))})


def leave_the_group() -> None:
    """The broken group's connections closed, the group aborted and destroyed (no local of this frame outlives the
    call)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_backend() == "gloo":
            close_the_connections()
        abort = getattr(dist.group.WORLD, "abort", None)  # torch's own end of a group whose peer is gone
        if abort is not None:
            abort()
        dist.destroy_process_group()


def close_the_connections() -> None:
    """gloo: close this process's connections to its peers now. A peer may wait on this process alone (the ordered
    sum passes its total between neighbours: only the lost rank's neighbours see their call fail), and the group
    stays alive after its destruction while anything still holds it; gloo closes every connection of a group whose
    receive timed out, and the waiting peer's call then fails at once instead of at --timeout-s. A receive on a tag
    nothing sends, from each peer: the first live one times out, the rest (and any peer gone) fail at once."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for peer in [(rank + offset) % world for offset in range(1, world)]:
        try:
            work = dist.irecv(torch.empty(1), peer, tag=UNUSED_TAG)
            if work is not None:  # (None only for a rank outside the group)
                work.wait(datetime.timedelta(milliseconds=1))
        except Exception:  # the timeout (every connection closed), or a connection closed already
            continue


def step_the_survivors_hold() -> int | None:
    """The step every survivor in this process's group holds in memory (the launcher's plan), once: a process that
    does not hold it (a replacement) is given a survivor's copy. None where a member reads the step's files (a
    process that saved nothing)."""
    held = os.environ.pop(HELD_STEP, None)
    return int(held) if held is not None else None


def held_by_every_survivor(reports: dict[str, dict[str, Any]], step: int | None) -> int | None:
    """`step`, where every survivor reported that it holds it in memory."""
    holding = [report.get("held") and report.get("step") == step for report in reports.values()]
    return step if step is not None and holding and all(holding) else None


def rejoin(facts: Facts | None, timeout_s: float = REPORT_TIMEOUT_S) -> None:
    """Leave the broken group, report, wait for the launcher's next generation and take its place in it: the
    launch variables (RANK, WORLD_SIZE), and the command's resume (`--resume-from-checkpoint latest`, and the
    per-process batch the launcher chose)."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    leave_the_group()
    # Accelerate keeps the world it was built in for the process's life; the next main builds it again. Its resets
    # are the ones its own tests use (no public one).
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    gc.collect()  # the old model, optimizer and loaders freed before the next main builds its own (device memory)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the old group's blocks, for the processes of the next
    generation, slot = int(os.environ[GENERATION]), os.environ[SLOT]
    store = store_client(timeout_s)
    store.set(f"{KEY}/saved_{generation}/{slot}", json.dumps(dataclasses.asdict(facts) if facts else {}))
    store.add(f"{KEY}/reported_{generation}", 1)  # (the launcher's sign of a peer lost while every process runs)
    missing = f"the launcher formed no new group within {timeout_s:g} s; resume with --resume-from-checkpoint latest"
    plan = json.loads(waited(store, f"{KEY}/generation_{generation + 1}", timeout_s, missing))
    take_place(generation + 1, plan)
    sys.argv[1:] = resumed_arguments(sys.argv[1:], plan.get("batch_size"))


def resumed_arguments(arguments: list[str], batch_size: int | None) -> list[str]:
    """The command's arguments, resumed from the latest checkpoint, with `batch_size` a process when given (the
    last of a repeated option is the one argparse keeps)."""
    resumed = [*arguments, "--resume-from-checkpoint", "latest"]
    return [*resumed, "--batch-size", str(batch_size)] if batch_size else resumed


class Spares:
    """`count` processes started ahead of any loss, each waiting to be called once its imports are done: a loss that
    needs a replacement takes a ready one (`take`), and `fill` starts another in its place. Each spare has a slot of
    its own past the group's (`first_slot` on), with that slot's GPU from its start (CUDA reads its visible devices
    once): the spare that takes a lost slot swaps GPUs with it, and its successor starts on the lost one's."""

    def __init__(self, count: int, start: Callable[[str], tuple[subprocess.Popen, int]], store: Any, first_slot: int):
        self.start, self.store = start, store
        self.slots = [str(first_slot + index) for index in range(count)]
        self.waiting: dict[str, tuple[subprocess.Popen, int]] = {}  # slot -> (process, its start's number: its keys)
        self.ready: set[int] = set()  # the starts of those whose imports are done (said once)

    def fill(self) -> None:
        for slot in self.slots:
            if slot not in self.waiting or self.waiting[slot][0].poll() is not None:  # (one ended meanwhile)
                self.waiting[slot] = self.start(slot)

    def say_the_ready(self) -> None:
        for process, start in self.waiting.values():
            if start not in self.ready and self.store.check([f"{KEY}/ready/{start}"]):
                self.ready.add(start)
                print(f"ddp-accel launch: a spare is ready (pid {process.pid})", file=sys.stderr, flush=True)

    def ready_for(self, lost: int) -> bool:
        """Whether ready spares can replace `lost` processes at once."""
        self.say_the_ready()
        return sum(process.poll() is None and start in self.ready for process, start in self.waiting.values()) >= lost

    def take(self, slot: str, devices: list[str] | None) -> tuple[subprocess.Popen, int] | None:
        """A spare whose imports are done, for `slot`, no longer a spare (None: none is ready); `devices`, each slot's
        GPU, then gives `slot` the spare's."""
        self.say_the_ready()
        for own, (process, start) in self.waiting.items():
            if process.poll() is None and start in self.ready:
                del self.waiting[own]
                if devices is not None:  # (the lost process is gone: its GPU is the next spare's)
                    devices[int(slot)], devices[int(own)] = devices[int(own)], devices[int(slot)]
                line = f"ddp-accel launch: a spare (pid {process.pid}, its imports done) takes the place of slot {slot}"
                print(line, file=sys.stderr, flush=True)
                return process, start
        return None

    def processes(self) -> list[subprocess.Popen]:
        return [process for process, _ in self.waiting.values()]


class Launcher:
    """Starts `processes` processes of `command` on this machine around a store of its own, and forms a new group
    after each loss (the module's docstring). Returns the command's exit status from `run`."""

    def __init__(
        self,
        command: list[str],
        processes: int,
        report_timeout_s: float = REPORT_TIMEOUT_S,
        min_processes: int | None = None,
        stopped_timeout_s: float | None = None,
        spares: int = 0,
    ):
        import torch.distributed as dist

        self.command, self.processes, self.report_timeout_s = command, processes, report_timeout_s
        self.min_processes = min_processes or processes  # fewer survivors than this: replacements
        self.stopped_timeout_s = stopped_timeout_s or STOPPED_TIMEOUT_S
        self.stopped_since: dict[str, float] = {}
        # each slot's GPU, the spares' past the group's (None: a CPU run, or fewer GPUs than slots)
        self.devices = slot_devices(processes + spares)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.generation = 0
        self.everyone = [str(slot) for slot in range(processes)]  # the first group's, in rank order
        self.members = list(self.everyone)
        self.running: dict[str, subprocess.Popen] = {}
        # replacements waiting to be called into a generation: slot -> (process, its start's number: its keys)
        self.joining: dict[str, tuple[subprocess.Popen, int]] = {}
        self.starts = 0
        self.facts: Facts | None = None  # the run's, from the first loss
        self.held: int | None = None  # the step the current generation's survivors hold (its replacements: given)
        self.lost_steps: list[int] = []
        self.received: list[int] = []
        self.error_code = 0  # a process that ended with an error of its own while the others reported (this loss)
        spare = lambda slot: (self.start(slot, resume=True, joins=True), self.starts)  # noqa: E731 (its start's number)
        self.spares = Spares(spares, spare, self.store, processes)

    def start(self, slot: str, *, resume: bool = False, joins: bool = False, lost_at: float = 0) -> subprocess.Popen:
        """A process for `slot`: its place in the current group (a replacement that joins: in the first group's; a
        spare, a slot past the group's: none until its call)."""
        members = self.everyone if joins else self.members
        rank, world = (members.index(slot), len(members)) if slot in members else (0, len(self.everyone))
        self.starts += 1
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            **launch_variables(rank, world),
            # its slot's GPU alone: a survivor keeps its device whatever rank it takes later, a replacement takes the
            # lost one's (Accelerate picks LOCAL_RANK modulo the devices it sees)
            **({"CUDA_VISIBLE_DEVICES": self.devices[int(slot)]} if self.devices else {}),
            GENERATION: str(self.generation),
            SLOT: slot if slot in self.everyone else SPARE,
            LAUNCHER: str(os.getpid()),
            **({JOINS: str(self.starts)} if joins else {}),
            **({LOST_AT: str(lost_at)} if lost_at else {}),
            **({HELD_STEP: str(self.held)} if self.held is not None and not joins else {}),
        }
        arguments = resumed_arguments(self.command[1:], None) if resume else self.command[1:]
        # a session of its own, as torch elastic starts its workers: a Ctrl-C reaches it once, from here
        return subprocess.Popen([self.command[0], *arguments], env=env, start_new_session=True)

    def run(self) -> int:
        previous = {signum: signal.signal(signum, self.on_signal) for signum in FORWARDED}
        try:
            for slot in self.members:
                self.running[slot] = self.start(slot)
            self.spares.fill()
            return self.watch()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.end_all()

    def on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        for process in [*self.running.values(), *(process for process, _ in self.joining.values())]:
            process.send_signal(signum)  # a preemption or Ctrl-C: every process saves and ends
        end_processes([], self.spares.processes())  # (nothing to save: a stop's marker is the group's to write)

    def watch(self) -> int:
        while self.running:
            end_the_stopped(self.running, self.members, self.stopped_since, self.stopped_timeout_s)
            ended = [slot for slot, process in self.running.items() if process.poll() is not None]
            for slot in sorted(ended, key=lambda slot: self.running[slot].returncode >= 0):  # deaths first: the
                if slot not in self.running:  # others' errors may be theirs (taken by the death's recovery)
                    continue
                code = self.running.pop(slot).returncode
                if code < 0 and not self.received:  # killed by a signal (SIGKILL, a crash): a loss to recover
                    if not self.recover(slot, code):
                        self.end_all()
                        return 1
                elif code != 0:  # an error with its own line (a user error: the same at every try), or a stop
                    self.end_all()
                    return code if code > 0 else 128 - code
            for slot, (process, _) in list(self.joining.items()):
                if process.poll() is not None:  # a replacement lost before its call: the survivors go on
                    del self.joining[slot]
            if self.running and not self.received and self.store.add(f"{KEY}/reported_{self.generation}", 0):
                if not self.recover(None):  # a survivor's collective timed out on a peer that runs, cut off
                    self.end_all()
                    return self.error_code or 1
                continue
            self.spares.say_the_ready()
            ready = [slot for slot, (_, start) in self.joining.items() if self.store.check([f"{KEY}/ready/{start}"])]
            if self.joining and len(ready) == len(self.joining) and self.running and not self.received:
                if not self.hand_back():
                    self.end_all()
                    return 1
            time.sleep(0.05)
        return 0

    def reports(self, silent_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Each running process's report of its save in this generation (rejoin's); a process that ends first is
        left out (a second loss while the group re-forms), one silent past `silent_s` (default: the report
        timeout) is ended."""
        started, reports, silent_s = time.monotonic(), {}, silent_s or self.report_timeout_s
        while not self.received:
            end_the_stopped(self.running, self.members, self.stopped_since, self.stopped_timeout_s)
            for slot, process in list(self.running.items()):
                key = f"{KEY}/saved_{self.generation}/{slot}"
                if slot not in reports and self.store.check([key]):
                    reports[slot] = json.loads(self.store.get(key))
                elif slot not in reports and process.poll() is not None:
                    del self.running[slot]
                    if process.returncode > 0:  # an error of its own (its line says which), not a loss
                        self.error_code = self.error_code or process.returncode
            if set(reports) == set(self.running):
                return reports
            if time.monotonic() - started > silent_s:
                for slot in set(self.running) - set(reports):  # alive but silent (stopped, cut off): ended
                    rank = self.members.index(slot) if slot in self.members else slot
                    end_the_silent(self.running.pop(slot), f"rank {rank} silent for {silent_s:.0f} s")
                return reports
            time.sleep(0.02)
        return {}  # stopped meanwhile: no new group

    def next_generation(
        self, members: list[str], batch_size: int | None, how: str, held: int | None = None, **moments: float
    ) -> None:
        """The next generation's plan, for its members (`moments`: lost_at, called_at: when its first step is timed
        from)."""
        self.generation += 1
        self.members, self.held = members, held
        plan = {"members": members, "batch_size": batch_size, "held": held, **moments}
        self.store.set(f"{KEY}/generation_{self.generation}", json.dumps(plan))
        print(f"ddp-accel launch: generation {self.generation}: {how}", file=sys.stderr, flush=True)

    def recover(self, lost: str | None, code: int = 0) -> bool:
        """A process died (`lost`, ended by `code`), or (None) a survivor reported while every process still runs:
        its collective timed out (`--timeout-s`) on a peer alive but cut off (a deadlock, a wait in the kernel), and
        whoever stays silent past the stopped bound is ended. Then the survivors' reports and the next generation
        (`regroup`). False where the job ends instead (said)."""
        lost_at, self.error_code = time.time(), 0  # (an earlier generation's collateral error is not this one's)
        self.store.set(f"{KEY}/abandoned_{self.generation}", "1")  # any member still waiting to meet: report again
        if lost is None:
            what, silent_s = "a process left its group while every process runs", self.stopped_timeout_s
        else:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(code)
            what, silent_s = f"rank {self.members.index(lost)} ended by {name}", None
        print(f"ddp-accel launch: {what}; recovering in process", file=sys.stderr, flush=True)
        reports = self.reports(silent_s)
        if lost is None and self.error_code:  # not cut off: it failed on its own, and would again at every try
            return False
        return self.regroup(reports, lost_at)

    def regroup(self, reports: dict[str, dict[str, Any]], lost_at: float) -> bool:
        """The next generation after a loss: the survivors alone where they keep the global batch bitwise (a
        replacement starts for each lost process, to be called in later: `hand_back`), else the first group's size
        again at once, with replacements."""
        if not reports and self.store.check([f"{KEY}/completed_{self.generation}"]):  # rank 0 wrote the outputs
            print("ddp-accel launch: the run had ended (rank 0 done): nothing to recover", file=sys.stderr, flush=True)
            return True
        step = max((report["step"] for report in reports.values() if report), default=None)
        lost = [slot for slot in self.everyone if slot not in reports and slot not in self.joining]
        none_lost = not lost and not self.joining  # (a process's DataLoader worker was)
        refusal = refusal_to_go_on(reports, step, self.lost_steps, none_lost)
        if refusal is not None:
            if reports or not self.received:  # (stopped meanwhile: no line)
                print(f"error: in-process recovery: {refusal}", file=sys.stderr, flush=True)
            return False
        first = next((report for report in reports.values() if report), None)
        self.facts = self.facts or (Facts(**first) if first else None)  # None: lost before anything was trained
        self.lost_steps.append(step if step is not None else -1)
        at = f" at step {step}" if step is not None else " from the last checkpoint"
        survivors = sorted(reports, key=self.everyone.index)
        share = self.facts.shares(len(survivors)) if self.facts else None
        held = held_by_every_survivor(reports, step)  # (no one reads the step's files: a replacement is given it)
        if none_lost:  # the same processes go on
            self.next_generation(survivors, share, f"the {len(survivors)} processes go on{at}", held, lost_at=lost_at)
            return True
        replaced = len(survivors) < self.min_processes
        if share is not None and not (replaced and self.spares.ready_for(len(lost))):  # (ready spares: join now)
            how = f"{len(survivors)} survivors go on{at}, {share} samples each"
            how += "" if replaced else f" to the end (--min-processes {self.min_processes}: no replacement)"
            self.next_generation(survivors, share, how, held, lost_at=lost_at)
            for slot in lost if replaced else []:  # called in once its imports are done: hand_back
                self.joining[slot] = (self.start(slot, resume=True, joins=True), self.starts)
            return True
        # the first group's size again, each process with its first batch: replacements now (and any waiting)
        how = f"{len(lost) + len(self.joining)} replacement(s) join the {len(survivors)} survivors{at}"
        batch_size = self.facts.shares(len(self.everyone)) if self.facts else None
        self.next_generation(list(self.everyone), batch_size, how, held, lost_at=lost_at)  # (held: given to them)
        for slot in lost:
            spare = self.spares.take(slot, self.devices)  # (its imports done: no process started after the loss)
            if spare is None:
                self.running[slot] = self.start(slot, resume=True, lost_at=lost_at)
            else:
                self.joining[slot] = spare
        self.call_the_replacements_in()
        self.spares.fill()
        return True

    def hand_back(self) -> bool:
        """The replacements are ready: the survivors stop together at a step (each keeps its copy, which the
        replacements are given, or all save it) and all of them form the next generation, each process with the
        first group's per-process batch (the replacements': their command's). A survivor lost meanwhile is a loss."""
        self.store.set(f"{KEY}/hand_back_{self.generation}", "1")
        called_at = time.time()  # (its first step is timed from here: the survivors' stop and copy included)
        for process in self.running.values():
            process.send_signal(HAND_BACK_SIGNAL)
        survivors = list(self.running)
        reports = self.reports()
        if set(reports) != set(survivors):
            return self.regroup(reports, time.time())
        assert self.facts is not None
        members, step = list(self.everyone), next(iter(reports.values()), {}).get("step")
        how = f"{len(self.joining)} replacement(s) take their share back"
        held = held_by_every_survivor(reports, step)  # (each survivor kept its copy: the replacements are given it)
        self.next_generation(members, self.facts.shares(len(members)), how, held, called_at=called_at)
        self.call_the_replacements_in()
        return True

    def call_the_replacements_in(self) -> None:
        for slot, (process, start) in self.joining.items():
            call = {"generation": self.generation, "slot": slot}
            self.store.set(f"{KEY}/called/{start}", json.dumps(call))
            self.running[slot] = process
        self.joining.clear()

    def end_all(self) -> None:
        end_processes(list(self.running.values()), [*(p for p, _ in self.joining.values()), *self.spares.processes()])
        self.running.clear()
        self.joining.clear()


def end_processes(running: list[subprocess.Popen], waiting: list[subprocess.Popen]) -> None:
    """The group's processes asked to end (a stop: they save the step reached), those waiting to be called in
    killed (nothing to save, and deaf to a signal in the store's wait); each waited for."""
    for process in waiting:  # (each leads a session of its own: its forkserver, started early, ends with it)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    for process in running:
        if process.poll() is None:
            process.terminate()
    for process in [*running, *waiting]:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def refusal_to_go_on(
    reports: dict[str, dict[str, Any]], step: int | None, lost_steps: list[int], none_lost: bool
) -> str | None:
    """Why the launcher ends the job instead of forming the next generation (None: it goes on)."""
    if not reports:
        return "no process survived to go on"
    if step is not None and lost_steps[-1:] == [step]:  # a crash at the same step would come back again
        return (
            f"a process was lost at step {step} twice; not going on (the same command with --resume-from-checkpoint "
            "latest resumes there)"
        )
    if none_lost and not any(reports.values()):  # none lost, and none reached a step: an error that repeats
        return (
            "every process failed in a collective, and none was lost (it would fail again the same way); their lines "
            "say where"
        )
    return None


def launch(
    script_command: list[str],
    processes: int,
    env: dict[str, str] | None = None,
    min_processes: int | None = None,
    stopped_timeout_s: float | None = None,
    spares: int = 0,
) -> int:
    """`ddp-accel launch --recover in-process`: `script_command` (the script and its arguments) on `processes`
    processes of this machine, with `env` added to their environment (accelerate launch's settings); survivors that
    number `min_processes` (default: all) and keep the global batch finish the run without replacements; a process
    stopped for `stopped_timeout_s` (default STOPPED_TIMEOUT_S) is ended and recovered from as lost; `spares`
    processes wait, imported, to replace a lost one at once."""
    os.environ.update(env or {})
    if spares and slot_devices(processes + spares) is None and slot_devices(processes) is not None:
        wanted = f"{processes + spares} GPUs for {processes} processes and {spares} spare(s)"
        print(f"error: --spares: a spare needs a GPU of its own from its start: {wanted}", file=sys.stderr, flush=True)
        return 2
    command = [sys.executable, *script_command]
    launcher = Launcher(
        command, processes, min_processes=min_processes, stopped_timeout_s=stopped_timeout_s, spares=spares
    )
    return launcher.run()


def end_the_stopped(
    running: dict[str, subprocess.Popen], members: list[str], stopped_since: dict[str, float], bound_s: float
) -> None:
    """A process stopped past `bound_s` (SIGSTOP, a stuck driver) is alive but cut off: its peers wait for it in a
    collective. It is ended, and its end recovered from as a loss (a debugger's stop is left alone);
    `stopped_since`: when each stopped process was first seen stopped."""
    now = time.monotonic()
    for slot, process in running.items():
        if process_state(process.pid) != "T":
            stopped_since.pop(slot, None)
            continue
        stopped_s = now - stopped_since.setdefault(slot, now)
        if stopped_s > bound_s:
            rank = members.index(slot) if slot in members else slot
            print(
                f"ddp-accel launch: rank {rank} stopped for {stopped_s:.0f} s (SIGSTOP, a stuck driver): ended, "
                "and recovered from as lost",
                file=sys.stderr,
                flush=True,
            )
            process.kill()
            del stopped_since[slot]


def end_the_silent(process: subprocess.Popen, who: str) -> None:
    """A process silent while its peers reported: ended, and waited for (its device's memory given back before a
    replacement starts there; one waiting in the kernel ends when it leaves it)."""
    print(
        f"ddp-accel launch: {who} while its peers reported (cut off: a deadlock, a wait in the kernel): ended, and "
        "recovered from as lost",
        file=sys.stderr,
        flush=True,
    )
    process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def slot_devices(processes: int) -> list[str] | None:
    """The GPU of each of `processes` slots: the visible ones in order (CUDA_VISIBLE_DEVICES, accelerate's gpu_ids),
    else all. None on a CPU run, or with fewer GPUs than processes (Accelerate shares them out by LOCAL_RANK)."""
    import torch

    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return None
    count, visible = torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
    # (CUDA reads the visible list up to its first entry that names no device: the count says how far)
    devices = visible.split(",")[:count] if visible is not None else [str(index) for index in range(count)]
    return [device.strip() for device in devices[:processes]] if len(devices) >= processes else None


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process (`T`: stopped by a signal; `t`: by a debugger), '' if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""
