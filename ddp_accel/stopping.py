"""Why training must stop before its end, agreed by every rank at each optimizer step: a preemption signal
(SIGTERM, SIGUSR1) that may reach only some ranks, or a loss that is no longer finite.

One small all-reduce (MAX) per optimizer step carries both flags. On a GPU it is not waited for at once: its
result is copied to pinned host memory and read at the next step, so the host never waits for the step in
flight (one step of lag); before a checkpoint or an evaluation the current step's result is awaited.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT_CODE = 0  # a launcher neither restarts the group in place nor reports a crash; see docs/clusters.md
PREEMPTED_MARKER = "preempted.json"  # in the output dir: the run stopped early and holds a checkpoint of its last step


# what run_main says after Ctrl-C: fit keeps it current (the newest checkpoint, how to resume)
RUN = {"resume_hint": "No checkpoint was saved (--checkpointing-steps N saves every N steps)."}


class Preempted(BaseException):
    """Raised by fit() once every rank has saved the checkpoint of the step reached. A BaseException, so that
    `except Exception` in user code does not swallow it; run_main turns it into PREEMPTED_EXIT_CODE."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass
class Verdict:
    step: int  # the optimizer step the flags were raised at
    signal: str | None  # the preemption signal some rank received (the highest-numbered, if several)
    nonfinite: bool


class PreemptionSignals:
    """While active, SIGTERM and SIGUSR1 only set a flag (the first signal's number is kept)."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> PreemptionSignals:
        for signum in PREEMPTION_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread (e.g. a debug launcher): no handler, no preemption stop
                break
        return self

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


class StepAgreement:
    """Per optimizer step: every rank's (loss not finite, preempted) flags, combined with one MAX all-reduce.

    On a CPU the flags are plain Python values until the all-reduce (none at all with one process): the check costs
    a few microseconds a step. On a GPU they stay on the device and are read one step late (see the module doc).
    """

    def __init__(self, accelerator):
        self.accelerator, self.device = accelerator, accelerator.device
        self.lagged = self.device.type == "cuda"
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.skipped_steps = 0  # fp16: optimizer steps the gradient scaler skipped (inf/nan gradients)
        self.step_nonfinite = torch.zeros((), device=self.device) if self.lagged else False  # any micro-batch
        self._host = torch.zeros(2, pin_memory=self.lagged)
        self._pending: tuple[int, torch.cuda.Event | None] | None = None

    def step_done(self, step: int, signum: int | None, wait: bool = False) -> Verdict | None:
        """After optimizer step `step`: a verdict when the ranks agree to stop. `wait`: this step's verdict
        (before a checkpoint or an evaluation), else possibly the previous step's (GPU)."""
        self.skipped_steps += self.accelerator.optimizer_step_was_skipped
        # With fp16, inf/nan is the gradient scaler's business: it skips the step and halves the scale. Only a
        # scale driven below 1 (from 65536: a long run of overflows) means the run itself diverged.
        scaler = self.accelerator.scaler
        count_nonfinite = scaler is None or scaler.get_scale() < 1.0
        verdict = self.submit(step, signum or 0, count_nonfinite)
        return verdict or (self.flush() if wait else None)

    def observe(self, loss: torch.Tensor) -> None:
        """Each micro-batch's loss (on a GPU without a host sync)."""
        if self.lagged:
            self.step_nonfinite = torch.maximum(self.step_nonfinite, (~torch.isfinite(loss)).float())
        else:
            self.step_nonfinite = self.step_nonfinite or not math.isfinite(loss.item())

    def submit(self, step: int, signum: int, count_nonfinite: bool = True) -> Verdict | None:
        """Start the agreement on `step`. Returns the newest finished verdict that says stop, else None: on CPU
        this step's, on a GPU the previous step's (the host does not wait for the step in flight)."""
        if not self.lagged:
            flags = [float(self.step_nonfinite and count_nonfinite), float(signum)]
            self.step_nonfinite = False
            if self.distributed:
                self._host.copy_(torch.tensor(flags))
                dist.all_reduce(self._host, op=dist.ReduceOp.MAX)
                flags = self._host.tolist()
            return self._verdict(step, *flags)
        previous = self._collect()
        flags = torch.stack(
            [self.step_nonfinite * float(count_nonfinite), torch.full((), float(signum), device=self.device)]
        )
        self.step_nonfinite = torch.zeros((), device=self.device)
        if self.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (step, event)
        return previous

    def flush(self) -> Verdict | None:
        """Wait for the newest submitted step's verdict (before a checkpoint or an evaluation)."""
        return self._collect()

    def _collect(self) -> Verdict | None:
        if self._pending is None:
            return None
        step, event = self._pending
        event.synchronize()
        self._pending = None
        return self._verdict(step, *self._host.tolist())

    @staticmethod
    def _verdict(step: int, nonfinite: float, signum: float) -> Verdict | None:
        name = signal.Signals(int(signum)).name if signum else None
        return Verdict(step, name, bool(nonfinite)) if nonfinite or signum else None
