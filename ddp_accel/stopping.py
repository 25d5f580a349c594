"""Why training must stop before its end, and how every process of a job stops in order.

A preemption signal (SIGTERM, SIGUSR1; SIGHUP from a closed terminal) may reach every process of a job at any
moment of its life, or only some ranks. `StopSignals` is the process's one record of it, from `run_main`'s start to
the exit, with the phase the run is in:

- `startup` (arguments, data, model, resume): nothing is trained yet, so the signal ends the process at once
  (`Preempted` raised from the handler) with a marker that says so; the job script requeues it.
- `train`, `eval`, `final` (the training loop, an evaluation, the last evaluations before the commit): the signal
  only sets a flag. The ranks agree on it (ddp_accel.agreement: a small all-reduce per optimizer step and per
  evaluation batch), save the training state of the step reached, write the marker, and exit 0.
- `commit`, `done` (the final artifacts are written, the run is complete): the flag is noted and the work finishes.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

from ddp_accel import launch_environments
from ddp_accel.startup import SIGNALS, write_marker
from ddp_accel.versions import major_minor

# SIGHUP: a closed terminal or SSH session saves and stops like a preemption (unless started under nohup)
PREEMPTION_SIGNALS = SIGNALS  # (SIGTERM, SIGUSR1, SIGHUP): the start-up guard's, which imports no torch
PREEMPTED_EXIT_CODE = 0  # a launcher neither restarts the group in place nor reports a crash; see docs/clusters.md
# a rank that stopped only because a peer was signalled: non-zero, so that its elastic agent (which was not signalled)
# forms the group again with the machines that remain (a node leaving), instead of ending the run unfinished
PEER_STOPPED_EXIT_CODE = 3
PREEMPTED_MARKER = "preempted.json"  # in the output dir: the run stopped early; `phase` says where
NO_CHECKPOINT_HINT = "No checkpoint was saved (--checkpointing-steps N saves every N steps)."


class Phase(enum.StrEnum):
    """Where a run is; preempted.json records it (as its value)."""

    STARTUP = "startup"
    TRAIN = "train"
    EVAL = "eval"
    FINAL = "final"
    COMMIT = "commit"
    DONE = "done"


@dataclass
class StopFacts:
    """What a preemption stop did: preempted.json holds these fields (and the time), and `Preempted` carries them."""

    phase: Phase
    signal: str | None
    step: int | None = None  # None: stopped before training, nothing saved
    checkpoint: str | None = None
    save_s: float | None = None

    @property
    def before_training(self) -> bool:
        return self.phase is Phase.STARTUP

    def write(self, output_dir: Path) -> None:
        """preempted.json (by startup.write_marker, its one writer: the job script and the next run read it)."""
        fields = {"phase": self.phase.value, "signal": self.signal, "step": self.step, "checkpoint": self.checkpoint}
        write_marker(output_dir, {**fields, **({"save_s": self.save_s} if self.save_s is not None else {})})

    @staticmethod
    def last_save_s(output_dir: Path) -> float:
        """The save time the last stop in `output_dir` recorded (0 if none or unreadable)."""
        try:
            return float(json.loads((output_dir / PREEMPTED_MARKER).read_text()).get("save_s") or 0)
        except (OSError, ValueError, TypeError, AttributeError):
            return 0.0


class Preempted(BaseException):
    """Raised once the run stopped for a preemption signal (after every rank saved, when there was anything to
    save). A BaseException, so that `except Exception` in user code does not swallow it; run_main turns it into
    PREEMPTED_EXIT_CODE. `by_peer`: the signal reached another rank, not this one."""

    def __init__(self, facts: StopFacts, by_peer: bool = False):
        self.facts, self.by_peer = facts, by_peer
        super().__init__(self.message)

    @property
    def message(self) -> str:
        facts = self.facts
        if facts.before_training:
            return (
                f"preempted by {facts.signal} before training started: nothing to save; to start, run the same "
                "command with --resume-from-checkpoint latest"
            )
        return (
            f"preempted by {facts.signal} at step {facts.step} ({facts.phase}): checkpoint {facts.checkpoint} saved "
            f"in {facts.save_s or 0:.2f} s; to continue, run the same command with --resume-from-checkpoint latest"
        )


class EndedForAPeer(BaseException):
    """A stop signal before training from the launcher ending the group because another process failed (its own
    line says why): not a preemption, so no marker (a job script would requeue the failure) and no line of this
    process's. A BaseException, raised from the signal handler, as Preempted. `code`: a signal's exit status."""

    def __init__(self, signum: int):
        self.code = 128 + signum
        super().__init__(f"ended by {signal.Signals(signum).name}: another process of the group failed")


_fork_hook_registered = False


def _leave_ctrl_c_to_the_parent_in_forked_children() -> None:
    """A child forked from a training process (a datasets.map pool worker, a DataLoader worker started by fork)
    ignores Ctrl-C: its parent gets the KeyboardInterrupt and ends it. A pool worker killed by Ctrl-C while it held
    the pool's task-queue lock left the lock held; the pool forked a worker in its place, which waited for that lock
    forever, and so did the parent's exit (datasets' multiprocess pool while it tokenises)."""
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_ignore_ctrl_c_in_forked_child)
        _fork_hook_registered = True


def _ignore_ctrl_c_in_forked_child() -> None:
    if StopSignals.current is None or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # not in a training process, or its SIGINT handling is someone else's
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread of the child (cannot happen after fork; no harm if it does)
        pass


class StopSignals:
    """The process's preemption state: the first signal received, the phase of the run, the output dir (for the
    marker) and the newest checkpoint (for the Ctrl-C hint). Created by `run_main` for the whole life of a script's
    process; `fit` makes one of its own when called without it and none is installed (notebooks)."""

    current: ClassVar[StopSignals | None] = None  # the installed one: one per process

    def __init__(self) -> None:
        self.received: int | None = None
        self.phase = Phase.STARTUP
        self.output_dir: Path | None = None
        self.resume_hint = NO_CHECKPOINT_HINT
        self.pid = os.getpid()  # the process these signals belong to
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        self.pid = os.getpid()
        _leave_ctrl_c_to_the_parent_in_forked_children()
        for signum in PREEMPTION_SIGNALS:
            if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # nohup: the user asked to outlive the terminal
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except (
                ValueError
            ):  # not the main thread: a launch environment's forwarder (Ray Train), else no preemption stop
                if _forwarded_from_main_thread.installed:
                    StopSignals.current = self
                    self.received = self.received or _forwarded_from_main_thread.received
                return self
        StopSignals.current = self
        # a program that blocked these signals before its imports: one that came meanwhile is handled now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if StopSignals.current is self:
            StopSignals.current = None

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def enter(self, phase: Phase) -> None:
        phase = Phase(phase)
        if self.phase is Phase.STARTUP and phase is Phase.TRAIN and self.received and self.output_dir is not None:
            self.stop_before_training()  # a signal forwarded during startup (the handler could not raise here)
        self.phase = phase

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received else None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:  # a process forked from ours (a datasets.map pool worker) inherited the handler:
            signal.signal(signum, signal.SIG_DFL)  # its pool ends it with SIGTERM; it must end, not write our marker
            os.kill(os.getpid(), signum)
            return
        self.received = self.received or signum
        # nothing trained, nothing to save: stop now, not after a long data preparation (once the marker's folder is
        # known: a signal during the imports or the argument parsing stops when the output dir is set)
        if self.phase is Phase.STARTUP and self.output_dir is not None:
            self.stop_before_training()

    def set_output_dir(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        if self.phase is Phase.STARTUP and self.received:
            self.stop_before_training()

    def stop_before_training(self) -> None:
        """Leave the marker of a run stopped before its first step (any rank may: the signal may reach only one)
        and raise Preempted; or raise EndedForAPeer, without the marker, when the launcher is ending the group."""
        if self.received and launch_environments.current().peer_failed():
            raise EndedForAPeer(self.received)
        facts = StopFacts(Phase.STARTUP, self.name)
        if self.output_dir is not None:
            facts.write(self.output_dir)
        raise Preempted(facts)


class _Forwarder:
    """Preemption signals caught on a process's main thread for a script that runs in another thread (Ray Train
    runs the training function in a thread of each worker, where `signal.signal` cannot be used): the handler only
    records the signal in the script's StopSignals, which acts on it at its next check (the next step's agreement;
    during startup, when training would begin), as a handler of its own does."""

    def __init__(self) -> None:
        self.installed = False
        self.received: int | None = None

    def install(self) -> None:
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._record)
        self.installed = True

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        current = StopSignals.current
        if current is not None:
            current.received = current.received or signum


_forwarded_from_main_thread = _Forwarder()


def request_stop(signum: int) -> None:
    """A stop asked by a launch environment's own notice (Ray's node preemption), from any thread: handled as that
    signal forwarded from the main thread (the ranks agree on a step, save it and stop)."""
    _forwarded_from_main_thread._record(signum, None)


def forward_stop_signals() -> None:
    """Call on the main thread of a process whose script will run in another thread (see `_Forwarder`)."""
    _forwarded_from_main_thread.install()


RAISE_ELASTIC_GRACE = "Raise TORCH_ELASTIC_SHUTDOWN_TIMEOUT (slurm/train.sbatch: GRACE_S) above the save time"
# `accelerate launch` of one process (Accelerate 1.16 and later) passes a SIGTERM on to the script's process tree
# and kills what still runs 5 s later; nothing sets another wait
ACCELERATE_ONE_PROCESS_GRACE_S = 5.0
ACCELERATE_LAUNCH_KILLS_FROM = (1, 16)
RAISE_ACCELERATE_GRACE = (
    "accelerate launch of one process waits 5 s (Accelerate 1.16 and later; not configurable): start the script "
    "with torchrun --nproc_per_node 1 (TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets its wait) or with python"
)


def launcher_grace(parent: list[str] | None = None) -> tuple[float, str] | None:
    """How long the launcher above this process waits after passing on a signal before it kills, and how to have
    longer: torch elastic's --shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default), a one-process
    `accelerate launch`'s fixed 5 s; None without such a launcher. `parent`: the parent's command line."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
            with contextlib.suppress(ValueError):
                if os.environ.get(name):
                    return float(os.environ[name]), RAISE_ELASTIC_GRACE
        return 30.0, RAISE_ELASTIC_GRACE
    command = launch_environments.parent_command() if parent is None else parent
    if launch_environments.is_accelerate_launch(command):
        from importlib.metadata import version

        if (major_minor(version("accelerate")) or (0, 0)) >= ACCELERATE_LAUNCH_KILLS_FROM:
            return ACCELERATE_ONE_PROCESS_GRACE_S, RAISE_ACCELERATE_GRACE
    return None


class SaveGrace:
    """A launcher passes a preemption signal on, then kills its processes after a grace of its own: a save that
    takes longer is lost. Said once (main process), at the first save that would not fit (or at start, from the
    save time the last stop recorded)."""

    def __init__(self, is_main_process: bool):
        self.is_main_process, self.warned = is_main_process, False
        self.grace = launcher_grace()

    def check(self, save_s: float) -> None:
        if self.grace is None or save_s <= self.grace[0] or self.warned:
            return
        self.warned = True
        if self.is_main_process:
            grace_s, how_to_raise = self.grace
            print(
                f"warning: saving a checkpoint takes {save_s:.0f} s, more than the {grace_s:.0f} s the launcher waits "
                f"after passing on a preemption signal before it kills the processes: a preempted run would lose it. "
                f"{how_to_raise}",
                file=sys.stderr,
                flush=True,
            )
