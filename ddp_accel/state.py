"""Where training is (`TrainState`) and who the run is (`RunIdentity`): together they are every checkpoint's
`training_state.json`, written by the checkpoint and read back on resume."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class RunIdentity:
    """Who the run is: the model's fingerprint (class, parameter names and shapes), `make_identity`'s options,
    data fingerprints and versions, and the optimizer's fingerprint. A checkpoint of another identity is refused,
    not loaded."""

    model_fingerprint: str = ""
    identity: dict[str, Any] = field(default_factory=dict)
    optimizer_fingerprint: str = ""  # its type and the options that shape its state (identity.optimizer_fingerprint)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Rebase:
    """A resume at another global batch or gradient accumulation: where this command continues."""

    saved_step: int  # the step as the checkpoint counted it
    saved_batch: int  # the checkpoint's global batch
    skip: int  # batches of this command's global batch to skip in the epoch
    leftover: int  # samples of the epoch seen before and seen again (a skip rounded down)
    step: int = 0  # the same place in this command's steps

    @property
    def recounted(self) -> bool:
        """Whether steps are counted in other units from here on (anything counted in steps must follow)."""
        return self.step != self.saved_step

    def steps_now(self, saved_steps: int) -> int:
        """A number of steps counted from the run's start in the checkpoint's steps, in this command's steps."""
        return round(saved_steps * self.step / self.saved_step) if self.saved_step else saved_steps

    def warning(self, state: TrainState, total_steps: int) -> str | None:
        """What changed, said once by the main process; None when nothing did."""
        global_batch, seen = state.global_batch, self.skip * state.global_batch + self.leftover
        if self.saved_batch == global_batch and self.saved_step == state.step:
            return None
        changed = (
            f"the global batch changed from {self.saved_batch} to {global_batch} samples: resuming after "
            f"{self.skip * global_batch} of the {seen} samples this epoch had seen"
            + (f" ({self.leftover} of them are seen again)" if self.leftover else "")
            if self.saved_batch != global_batch
            else f"the gradient accumulation changed: {self.skip} batches into epoch {state.epoch + 1}"
        )
        return (
            f"{changed}, at step {state.step} of this command's {total_steps} (step {self.saved_step} as the "
            "checkpoint counted); the LR schedule goes on from the same place in the data"
        )


@dataclass
class TrainState:
    """The position of training and what the loop must remember across a stop: `state_dict()` is what a checkpoint's
    training_state.json holds, `load_state_dict()` reads it back (also the checkpoints of earlier versions)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch in progress (or the next one, at an epoch boundary)
    batches_in_epoch: int = 0  # batches of `epoch` every rank consumed (micro-batches, with accumulation)
    global_batch: int = 0  # samples per batch over all processes
    world_size: int = 1
    epoch_samples: int = 0  # the training set's samples (an epoch, whatever the batch and world size; 0: unknown)
    last_loss: float | None = None  # the last logged training loss (None before the first log)
    last_eval_step: int = -1  # the step of the last complete evaluation
    eval_metrics: dict[str, Any] = field(default_factory=dict)  # its metrics (metrics.json reports them at the end)
    eval_pending: bool = False  # a stop interrupted the evaluation due at `step`: run it first after resume
    best_metric: float | None = None  # the best value of fit's `best_metric` so far, and its step
    best_step: int | None = None
    best_metric_name: str | None = None  # the metric best_metric and early_stopping_best are values of
    # early stopping: the value an improvement is measured from, the evaluations since, and whether it ended the run
    early_stopping_best: float | None = None
    evaluations_without_improvement: int = 0
    stopped_early: bool = False
    out_of_time: bool = False  # --time-budget: the machine ran slower than planned, training ended at an epoch's end
    time_budget: dict[str, Any] | None = None  # what --time-budget planned (budget.BudgetPlan), kept by a resume
    budget_spent_s: float = 0.0  # --time-budget: the seconds the run's commands spent so far, up to this step
    # the options that may change at a resume (config.CHANGEABLE_AT_RESUME), as this run trains with them: a resume
    # under other values says which in one line
    training_options: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_in_epoch(self) -> int:
        return self.batches_in_epoch * self.global_batch

    @property
    def samples_trained(self) -> int:
        """How far training got, in samples since its start: the same number at the same place in the data whatever
        the world size, batch size or accumulation (the padding of an epoch's last round not counted), so it only
        grows across a resize. The trackers' x axis and history.json's `samples`."""
        in_epoch = self.samples_in_epoch
        return self.epoch * self.epoch_samples + (min(in_epoch, self.epoch_samples) if self.epoch_samples else in_epoch)

    def progress(self) -> dict[str, int]:
        """How far training got, in a unit that does not change with the world size, batch size or accumulation
        (metrics.json's `progress`)."""
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch, "samples": self.samples_trained}

    @property
    def ended(self) -> bool:
        """Training ends before its length: early stopping, or the time budget."""
        return self.stopped_early or self.out_of_time

    def end_reason(self) -> str:
        """metrics.json's `end_reason`: early stopping (by `best_metric_name`), the time budget, or the run's length."""
        if self.out_of_time:
            return f"time budget: the machine ran slower than planned; training ended after epoch {self.epoch}"
        if self.stopped_early:
            return (
                f"early stopping: {self.best_metric_name} did not improve for {self.evaluations_without_improvement} "
                "evaluations"
            )
        return "completed"

    def switch_best_metric(self, name: str | None) -> str | None:
        """A resume under another --best-metric: the best so far was another metric's value (a loss of 2.3 is no
        top-1 to beat), so the best model and early stopping's count start again. Returns the checkpoint's metric
        when it was another one."""
        saved, self.best_metric_name = self.best_metric_name, name
        if saved is None or saved == name:
            return None
        self.best_metric = self.best_step = self.early_stopping_best = None
        self.evaluations_without_improvement = 0
        return saved

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_in_epoch": self.samples_in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Unknown keys are ignored. Checkpoints of the first versions hold only step, epoch,
        batches_in_epoch, samples_in_epoch, global_batch, world_size and model_fingerprint; the rest keeps its
        default, and a global batch they lack is derived from the samples seen."""
        known = {f.name for f in fields(self)}
        for key, value in state.items():
            if key in known:
                setattr(self, key, value)
        if not state.get("global_batch") and state.get("batches_in_epoch"):
            self.global_batch = state["samples_in_epoch"] // state["batches_in_epoch"]

    def rebase(self, global_batch: int, world_size: int, batches_per_epoch: int, accumulation: int) -> Rebase:
        """Continue with this command's global batch, world size and accumulation. The global sample order of an
        epoch depends on neither the world size nor the batch size, so another global batch skips by samples; the
        step is recounted from the position in the data (a last, partial accumulation group is a step), whatever
        the checkpoint's own step counted."""
        saved_batch, seen = self.global_batch or global_batch, self.samples_in_epoch
        skip, leftover = divmod(seen, global_batch)
        if saved_batch == global_batch:
            skip, leftover = self.batches_in_epoch, 0
        steps_per_epoch = math.ceil(batches_per_epoch / accumulation)
        done = steps_per_epoch if skip >= batches_per_epoch else skip // accumulation
        rebase = Rebase(self.step, saved_batch, skip, leftover, step=self.epoch * steps_per_epoch + done)
        self.step = rebase.step
        if self.best_step is not None:
            self.best_step = rebase.steps_now(self.best_step)
        if self.last_eval_step == rebase.saved_step:  # the evaluation of the place resumed from: not due again
            self.last_eval_step = self.step
        elif self.step != rebase.saved_step:  # an older one, counted in the checkpoint's steps
            self.last_eval_step = -1
        self.batches_in_epoch, self.global_batch, self.world_size = skip, global_batch, world_size
        return rebase
