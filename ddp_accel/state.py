"""Where training is: one object, saved as every checkpoint's `training_state.json` and loaded on resume."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class TrainState:
    """The position of training and what the loop must remember across a stop: `state_dict()` is what a checkpoint's
    training_state.json holds, `load_state_dict()` reads it back (also the checkpoints of earlier versions)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch in progress (or the next one, at an epoch boundary)
    batches_in_epoch: int = 0  # batches of `epoch` every rank consumed (micro-batches, with accumulation)
    global_batch: int = 0  # samples per batch over all processes
    world_size: int = 1
    model_fingerprint: str = ""
    last_loss: float | None = None  # the last logged training loss (None before the first log)
    last_eval_step: int = -1  # the step of the last complete evaluation
    eval_metrics: dict[str, Any] = field(default_factory=dict)  # its metrics (metrics.json reports them at the end)
    eval_pending: bool = False  # a stop interrupted the evaluation due at `step`: run it first after resume
    best_metric: float | None = None  # the best value of fit's `best_metric` so far, and its step
    best_step: int | None = None
    identity: dict[str, Any] = field(default_factory=dict)  # what shaped model and data (ddp_accel.identity)

    @property
    def samples_in_epoch(self) -> int:
        return self.batches_in_epoch * self.global_batch

    def loss_or_nan(self) -> float:
        return math.nan if self.last_loss is None else self.last_loss

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_in_epoch": self.samples_in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Unknown keys are ignored. Checkpoints written before this object (ddp_accel 729a739) hold step, epoch,
        batches_in_epoch, samples_in_epoch, global_batch, world_size and model_fingerprint; the rest keeps its
        default, and a global batch they lack is derived from the samples seen."""
        known = {f.name for f in fields(self)}
        for key, value in state.items():
            if key in known:
                setattr(self, key, value)
        if not state.get("global_batch") and state.get("batches_in_epoch"):
            self.global_batch = state["samples_in_epoch"] // state["batches_in_epoch"]
