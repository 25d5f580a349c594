"""`--checkpointing-steps auto`: the interval between checkpoints that minimises the expected time lost, chosen from
what this run measures (Young 1974, Daly 2006).

A failure costs the work since the last checkpoint, half an interval on average; checkpoints cost their stall each
time. For a save that stalls training C seconds and a mean time M between the failures that need a checkpoint, the
optimum is an interval of sqrt(2 C M) - C seconds of training (Daly's first order; M when C > M / 2).

- C: the stall the last save put on training, measured (a synchronous save's whole write; with
  --async-checkpoint the copy into memory, and the wait for the previous write).
- M: the mean time between interruptions, `--mtbf` (default 24 h), combined with this launch's own record: the
  launcher's restarts over the time since it started (a mean over (time + M) / (restarts + 1), so that one early
  failure moves it, and none leaves it at `--mtbf`).
- Only the failures a checkpoint must cover count: where a survivor saves the step it reached (DDP: every rank
  holds the whole state, ddp_accel.rescue), a failure of some of the ranks costs nothing; what remains is what
  takes every replica or gives no grace (a whole machine or job lost). Its share of interruptions is stated as
  UNCOVERED_SHARE: in Meta's Llama 3 405B pre-training (16,384 H100s, 54 days), 78% of the 419 unexpected
  interruptions were hardware faults, each one host's GPU or memory, which leave the other hosts' replicas.

The first save comes PROBE_STEPS steps into the command (it measures C); after each save the ranks agree on the
figures (the slowest rank's), so that every rank saves at the same step.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ddp_accel.config import format_duration

DEFAULT_MTBF_S = 24 * 3600.0
UNCOVERED_SHARE = 0.22  # where a survivor's save applies: the interruptions that take every replica
PROBE_STEPS = 20  # the first save, which measures a save's cost
TIMED_STEPS = 50  # the step pace: the median of the last ones (an evaluation's or a save's step is an outlier)


def launch_started_at() -> float:
    """When this launch began: under torch elastic, when its agent (this process's parent) started; else this
    process's start."""
    process = psutil.Process()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        with contextlib.suppress(psutil.Error, AttributeError):
            return process.parent().create_time()
    return process.create_time()


def best_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's first-order optimum: the seconds of training between checkpoints."""
    if save_s >= mtbf_s / 2:
        return mtbf_s
    return math.sqrt(2 * save_s * mtbf_s) - save_s


def expected_mtbf_s(prior_s: float, elapsed_s: float, restarts: int) -> float:
    """The mean time between interruptions, `prior_s` updated with `restarts` over `elapsed_s` (a gamma prior of
    one interruption in `prior_s`)."""
    return (elapsed_s + prior_s) / (restarts + 1)


class AutoInterval:
    """When a run of `--checkpointing-steps auto` saves. `mtbf_s`: --mtbf (None: DEFAULT_MTBF_S); `covered`:
    whether a survivor's save covers a failure of some of the ranks; `restarts`, `launched_at`: this launch's
    record (its launcher's restarts, its start as time.time())."""

    def __init__(
        self, mtbf_s: float | None, covered: bool, restarts: int, launched_at: float, device: Any = "cpu"
    ) -> None:
        self.prior_s, self.given = mtbf_s or DEFAULT_MTBF_S, mtbf_s is not None
        self.covered, self.restarts, self.launched_at, self.device = covered, restarts, launched_at, device
        self.next_step: int | None = None  # set at the first step seen: PROBE_STEPS later
        self.steps: collections.deque[float] = collections.deque(maxlen=TIMED_STEPS)
        self._last: float | None = None  # when the step before was first asked about, and which it was
        self._last_step: int | None = None
        self.chosen: tuple[int, float, float, float] | None = None  # (steps, seconds, save stall, mtbf), told once

    def describe(self) -> str:
        """The banner's line."""
        prior = format_duration(self.prior_s)
        mtbf = f"{prior} (--mtbf)" if self.given else f"{prior} (the default; --mtbf)"
        share = f"{UNCOVERED_SHARE:.0%} of them, those a survivor's save cannot cover" if self.covered else "all"
        return (
            f"auto: sqrt(2 x save stall x time between interruptions) of training (Young/Daly), from a save "
            f"{PROBE_STEPS} steps in, one interruption in {mtbf} and this launch's restarts, counting {share}"
        )

    def due(self, step: int) -> bool:
        if step != self._last_step:  # asked more than once a step
            now = time.perf_counter()
            if self._last is not None:
                self.steps.append(now - self._last)
            self._last, self._last_step = now, step
        if self.next_step is None:
            self.next_step = step + PROBE_STEPS - 1  # the PROBE_STEPS-th step of this command
        return step >= self.next_step

    def saved(self, step: int, stall_s: float) -> None:
        """After the save of `step` (every rank, together): the next one, from the slowest rank's figures."""
        self._last = None  # the save's own time is not a step's
        pace_s = sorted(self.steps)[len(self.steps) // 2] if self.steps else 0.0
        figures = [stall_s, pace_s, time.time() - self.launched_at]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor(figures, dtype=torch.float64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            figures = agreed.tolist()
        stall_s, pace_s, elapsed_s = figures
        mtbf_s = expected_mtbf_s(self.prior_s, elapsed_s, self.restarts)
        needing_a_checkpoint_s = mtbf_s / UNCOVERED_SHARE if self.covered else mtbf_s
        interval_s = best_interval_s(max(stall_s, 1e-3), needing_a_checkpoint_s)
        steps = max(1, round(interval_s / pace_s)) if pace_s > 0 else PROBE_STEPS
        self.next_step = step + steps
        previous = self.chosen
        self.chosen = (steps, interval_s, stall_s, mtbf_s)
        if previous is None or abs(steps - previous[0]) > 0.2 * previous[0]:
            self.say()

    def say(self) -> None:
        if self.chosen is None or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
            return
        steps, interval_s, stall_s, mtbf_s = self.chosen
        print(
            f"checkpoints: every {steps} steps (~{format_duration(interval_s)} of training): a save stalls training "
            f"{format_duration(stall_s)}, one interruption expected every {format_duration(mtbf_s)}"
            + (f", {UNCOVERED_SHARE:.0%} of them not covered by a survivor's save" if self.covered else ""),
            file=sys.stderr,
            flush=True,
        )
