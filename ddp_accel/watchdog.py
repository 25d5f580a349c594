"""A hang costs the whole allocation: each rank watches its own progress and, when none comes, says where it waits
and exits, so that a restart resumes from the newest checkpoint instead of waiting for the collective timeout.

`ProgressWatchdog` is a daemon thread. Training steps and evaluation batches are its heartbeats (`beat`). When no
beat comes within the bound, it writes the Python stack of every thread of the process and a line per DataLoader
worker (alive, started, what the kernel says it waits on) into `OUTPUT_DIR/hangs/rank_N.txt`, prints one line that
names the rank, the phase and where the main thread waits, kills the workers and ends the process with
`HANG_EXIT_CODE`: torchrun / `accelerate launch --max_restarts N` or the SLURM job script then restart the job,
which resumes from its newest checkpoint.

The bound comes from the run's own pace, so that a slow but progressing run is never stopped: before the first
steps and during long work done once in a while (the best model, the trackers, the first checkpoint save),
`first_s` (compilation, worker start-up, cuDNN autotuning, slow disks and servers take time); after it, `factor`
times the longest interval between two beats so far, at least `floor_s`, and for a later checkpoint save `factor`
times the longest save so far, at least that same bound (a rank stopped while its peer waits in a save's barrier
is found as fast as one stopped between steps). `--hang-timeout-s S` sets the
step bound to S seconds; 0 turns the watchdog off.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

HANG_EXIT_CODE = 4  # distinct from a crash (1), a user error (2) and a stop caused by a peer (3)


@dataclass(frozen=True)
class Bounds:
    """How long the watchdog waits: `first_s` before the first steps and for long work seen for the first time;
    then `factor` x the slowest interval between beats (or the longest save of a kind), at least `floor_s`."""

    floor_s: float = 120.0
    factor: float = 20.0
    first_s: float = 1800.0


class ProgressWatchdog:
    def __init__(
        self,
        output_dir: Path,
        rank: int,
        timeout_s: float | None = None,
        *,
        bounds: Bounds = Bounds(),
        phase: Callable[[], str] = lambda: "train",
        exit: Callable[[int], None] | None = None,
    ):
        self.output_dir, self.rank, self.timeout_s = Path(output_dir), rank, timeout_s
        self.floor_s, self.factor, self.first_s = bounds.floor_s, bounds.factor, bounds.first_s
        self.phase, self._exit = phase, exit
        self.last_beat = time.monotonic()
        self.last_what = "start"
        self.slowest = 0.0  # the longest interval between two beats so far
        self.beats = 0
        self.long_activity: str | None = None  # a checkpoint save, the trackers, the best model: the generous bound
        self.activity_kind: str | None = None
        self.longest_activity: dict[str, float] = {}  # per kind: its longest duration so far
        self.fired = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._main_thread = threading.get_ident()

    @property
    def enabled(self) -> bool:
        return self.timeout_s is None or self.timeout_s > 0

    def start(self) -> ProgressWatchdog:
        if self.enabled and self._thread is None:
            self._main_thread = threading.get_ident()  # the thread that trains (Ray runs it in a thread of its own)
            self.last_beat = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="ddp_accel-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._thread = None

    def beat(self, what: str) -> None:
        """A training step or an evaluation batch completed."""
        now = time.monotonic()
        if self.beats and self.long_activity is None:
            self.slowest = max(self.slowest, now - self.last_beat)
        self.beats += 1
        self.last_beat, self.last_what = now, what

    @contextlib.contextmanager
    def activity(self, what: str, kind: str | None = None) -> Iterator[None]:
        """Work that may take long once in a while (a checkpoint save, the trackers): watched with the generous
        bound; with a `kind` (a checkpoint save), only the first time, then with a bound from its longest duration
        (the trackers' servers and a best model's upload keep the generous bound: their pace is someone else's)."""
        previous = self.long_activity, self.activity_kind
        self.long_activity, self.activity_kind = what, kind
        started = time.monotonic()
        try:
            yield
        finally:  # the beat before the short bound returns: the watching thread reads the bound first (_watch)
            self.last_beat, self.last_what = time.monotonic(), what
            if kind is not None:
                self.longest_activity[kind] = max(self.longest_activity.get(kind, 0.0), self.last_beat - started)
            self.long_activity, self.activity_kind = previous

    def rearm(self) -> None:
        """The next steps are again first steps (after an evaluation that a resume ran before any step)."""
        self.beats, self.last_beat = 0, time.monotonic()

    def bound_s(self) -> float:
        longest = self.longest_activity.get(self.activity_kind) if self.activity_kind is not None else None
        if self.beats < 2 or (self.long_activity is not None and longest is None):
            return self.first_s
        step_bound = self.timeout_s or max(self.floor_s, self.factor * self.slowest)
        if self.long_activity is not None and longest is not None:  # a kind of work seen before
            return max(step_bound, self.factor * longest)
        return step_bound

    def _watch(self) -> None:
        # polled at a tenth of the smallest bound it can have, so that a bound that shrinks (after the first
        # steps, or a save) is kept to within 10%, however long the one in force when the wait began
        smallest = min(self.floor_s, self.timeout_s or self.floor_s)
        while not self._stopped.wait(min(5.0, max(0.05, smallest / 10))):
            bound = self.bound_s()  # before the beat: a long activity that just ended has beaten already
            waited = time.monotonic() - self.last_beat
            if waited > bound:
                self._fire(waited)
                return

    # --- the diagnosis ---
    def _fire(self, waited: float) -> None:
        self.fired.set()
        workers = worker_states()
        where = self.where_main_waits(workers)
        path = self.output_dir / "hangs" / f"rank_{self.rank}.txt"
        line = (
            f"error: rank {self.rank} made no progress for {waited:.3g} s (bound {self.bound_s():.3g} s) in phase "
            f"{self.phase()}, after {self.last_what}: {where}. Stacks of every thread and the DataLoader workers' "
            f"state in {path}. Exiting with status {HANG_EXIT_CODE}: a restart (--max_restarts, the SLURM job "
            "script) resumes from the newest checkpoint"
        )
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as report:
                report.write(line + "\n\nDataLoader workers:\n")
                report.writelines(f"  {worker.describe()}\n" for worker in workers)
                report.write("\nPython stacks of every thread (most recent call first):\n")
                report.flush()
                faulthandler.dump_traceback(report, all_threads=True)
        print("\n" + line, file=sys.stderr, flush=True)  # on a line of its own, after a progress bar
        for child in multiprocessing.active_children():  # the workers ignore SIGTERM
            if child.daemon:
                child.kill()
        (self._exit or os._exit)(HANG_EXIT_CODE)

    def where_main_waits(self, workers: list[WorkerState]) -> str:
        """One phrase: what the training thread waits for."""
        frame = sys._current_frames().get(self._main_thread)
        files = []
        while frame is not None:
            files.append((frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno))
            frame = frame.f_back
        if not files:
            return "the training thread is gone"
        filename, function, line = files[0]
        innermost = f"{function} ({Path(filename).name}:{line})"
        if any("torch/utils/data" in name for name, _, _ in files):
            unstarted = [worker for worker in workers if worker.alive and not worker.started]
            stuck = [worker for worker in workers if worker.alive]
            if unstarted:
                return f"it waits for DataLoader worker pid {unstarted[0].pid}, which never started ({innermost})"
            if stuck:
                return (
                    f"it waits for its DataLoader workers (pids {', '.join(str(w.pid) for w in stuck)}, "
                    f"{stuck[0].waits_on}) ({innermost})"
                )
            return f"it waits for its DataLoader, whose workers are gone ({innermost})"
        if function in ("backward", "run_backward", "_engine_run_backward"):
            return f"it waits in backward, for the gradient all-reduce: another rank is behind or gone ({innermost})"
        if any("torch/distributed" in name for name, _, _ in files):
            return f"it waits in a collective, for another rank ({innermost})"
        return f"it is in {innermost}"


class WorkerState:
    """What /proc says of one DataLoader worker."""

    def __init__(self, pid: int, alive: bool):
        self.pid, self.alive = pid, alive
        self.started, self.state, self.waits_on = False, "?", "?"
        with contextlib.suppress(OSError, ValueError, IndexError):
            status = {
                line.split(":")[0]: line.split(":", 1)[1].strip()
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            }
            # a worker's first act is to ignore SIGTERM (loaders._ignore_preemption): one that did not, never started
            self.started = bool(int(status["SigIgn"], 16) & (1 << (signal.SIGTERM - 1)))
            self.state = status["State"]
            self.waits_on = Path(f"/proc/{pid}/wchan").read_text().strip() or "running"

    def describe(self) -> str:
        return (
            f"pid {self.pid}: {'alive' if self.alive else 'gone'}, "
            f"{'started' if self.started else 'never started'}, state {self.state}, waits on {self.waits_on}"
        )


def worker_states() -> list[WorkerState]:
    return [
        WorkerState(child.pid or 0, child.is_alive()) for child in multiprocessing.active_children() if child.daemon
    ]
