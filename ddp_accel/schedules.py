"""`--lr-schedule`: the learning-rate schedules every script shares, each with a linear warm-up.

A schedule is a `LearningRateSchedule`, the factor of the peak `--lr` at each optimizer step, driven by torch's
LambdaLR (stepped once per optimizer step) through a plain function, so that LambdaLR's state dict keeps nothing
of it: the shape comes from this command (a longer run continues its cosine to its own end), and the only state,
reduce-on-plateau's factor and count, is saved in checkpoints by `PlateauFeed` and resumes exactly.

- constant: 1 after the warm-up.
- step: x `--lr-gamma` every `--lr-step-epochs` (pytorch/examples imagenet: 0.1 every 30).
- multistep: x `--lr-gamma` at each epoch of `--lr-milestones`.
- cosine: from 1 down to `--min-lr` / `--lr` at the end.
- linear: a straight line from 1 down to `--min-lr` / `--lr` at the end, after a warm-up in whole steps (rounded
  down, at least one: step 0 trains at 1), as Hugging Face's get_linear_schedule_with_warmup; imdb.py's schedule.
- onecycle: up from 1/25 over the warm-up (30% of the steps when `--warmup-epochs` is 0), then cosine down to
  `--min-lr` / `--lr` (Smith's one-cycle, as torch's OneCycleLR with its defaults).
- plateau: x `--lr-gamma` once the watched metric (`--best-metric`, else the script's) has not improved for
  `--plateau-patience` evaluations. Every rank sees the same gathered metrics, so every rank decides alike.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ddp_accel.callbacks import Callback
from ddp_accel.meters import improves

if TYPE_CHECKING:
    from ddp_accel.config import ScheduleOptions
    from ddp_accel.context import RunContext

ONECYCLE_START = 1 / 25  # torch's OneCycleLR div_factor
ONECYCLE_WARMUP_SHARE = 0.3  # torch's OneCycleLR pct_start


class LearningRateSchedule:
    def __init__(self, config: ScheduleOptions, total_steps: int, steps_per_epoch: int) -> None:
        self.name = config.lr_schedule
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        warmup = config.warmup_epochs * steps_per_epoch
        if self.name == "onecycle" and warmup == 0:
            warmup = ONECYCLE_WARMUP_SHARE * total_steps
        self.warmup = warmup  # in steps, not rounded (as pytorch/examples' warm-up)
        self.floor = config.min_lr / config.lr
        self.gamma, self.step_epochs = config.lr_gamma, config.lr_step_epochs
        self.milestones = sorted(config.lr_milestones or [])
        self.patience = config.plateau_patience
        # reduce-on-plateau's state: saved in LambdaLR's state dict (this object's __dict__)
        self.plateau_factor, self.evaluations_without_improvement = 1.0, 0
        self.plateau_best: float | None = None

    def __call__(self, step: int) -> float:
        if self.name == "linear":  # written as imdb.py's own schedule was: the same floats
            # whole steps; the 1e-6 counts a product such as 0.29 x 100 = 28.999999999999996 as the 29 meant
            warmup = max(1, int(self.warmup + 1e-6))
            if step < warmup:
                return (step + 1) / warmup
            decay = max(0.0, (self.total_steps - step) / max(1, self.total_steps - warmup))
            return self.floor + (1 - self.floor) * decay
        if self.name != "onecycle" and step < self.warmup:
            return (step + 1) / self.warmup
        epoch = step // max(1, self.steps_per_epoch)
        if self.name == "step":
            return self.gamma ** (step // (self.step_epochs * self.steps_per_epoch))
        if self.name == "multistep":
            return self.gamma ** sum(epoch >= milestone for milestone in self.milestones)
        if self.name == "onecycle" and step < self.warmup:
            return ONECYCLE_START + (1 - ONECYCLE_START) * step / max(1, self.warmup)
        if self.name in ("cosine", "onecycle"):  # written as imagenet.py's was: the same floats
            cosine = 0.5 * (1 + math.cos(math.pi * (step - self.warmup) / max(1, self.total_steps - self.warmup)))
            return self.floor + (1 - self.floor) * cosine
        if self.name == "plateau":
            return self.plateau_factor
        return 1.0

    def observe(self, metric: str, value: float) -> None:
        """reduce-on-plateau: one evaluation's value of the watched metric."""
        if improves(metric, value, self.plateau_best):
            self.plateau_best, self.evaluations_without_improvement = value, 0
            return
        self.evaluations_without_improvement += 1
        if self.evaluations_without_improvement >= self.patience:
            self.plateau_factor *= self.gamma
            self.evaluations_without_improvement = 0


def make_schedule(
    config: ScheduleOptions, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int
) -> tuple[Any, LearningRateSchedule]:
    """The LambdaLR of `config`'s schedule, and the schedule (reduce-on-plateau observes it)."""
    schedule = LearningRateSchedule(config, total_steps, steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step)), schedule


# schedulers whose LR at a step is a formula of the step alone (torch computes it in closed form): they can be put
# at any step. The others (ReduceLROnPlateau, CyclicLR, warm restarts, chains) depend on the path they took.
_STEP_FORMULA = (torch.optim.lr_scheduler.LambdaLR, torch.optim.lr_scheduler.OneCycleLR)


def move_to_step(scheduler: Any, step: int) -> bool:
    """Put an LR scheduler where `step` optimizer steps of this command put it, the learning rate of every group
    included: a resume at another global batch counts its steps again (TrainState.rebase), and the schedule's
    position must be counted in the same steps as its length, or the LR jumps at the resume and never reaches its
    end. False when the scheduler's LR is not a formula of the step (it then goes on from its saved position)."""
    inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps torch's
    if not isinstance(inner, _STEP_FORMULA) and not hasattr(inner, "_get_closed_form_lr"):
        return False
    update = getattr(inner, "_update_lr", None)
    if update is not None:  # torch >= 2.6: the body of step(epoch) without its deprecation warning
        update(step)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inner.step(step)
    return True


class PlateauFeed(Callback):
    """Gives each evaluation's watched metric to the reduce-on-plateau schedule."""

    state_key = "lr_plateau"

    def __init__(self, schedule: LearningRateSchedule, metric: str) -> None:
        self.schedule, self.metric = schedule, metric

    def on_evaluate(self, run: RunContext, metrics: dict[str, Any]) -> None:
        if self.metric in metrics and math.isfinite(metrics[self.metric]):
            self.schedule.observe(self.metric, metrics[self.metric])

    def state_dict(self) -> dict[str, Any]:
        schedule = self.schedule
        return {
            "plateau_factor": schedule.plateau_factor,
            "plateau_best": schedule.plateau_best,
            "evaluations_without_improvement": schedule.evaluations_without_improvement,
            "metric": self.metric,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.plateau_factor = state["plateau_factor"]  # the decays done stay done
        if state.get("metric", self.metric) == self.metric:  # another metric's best is no value to improve on
            self.schedule.plateau_best = state["plateau_best"]
            self.schedule.evaluations_without_improvement = state["evaluations_without_improvement"]
