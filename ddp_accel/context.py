"""What a callback sees of a run (`RunContext`): where training is, the accelerator, the prepared model and
optimizer, the run's folder, and the few actions a feature needs (evaluate the model, export it, wait for slow work
on the main process). Never the loop itself: a feature that needs more asks for a field here, typed and reviewed,
instead of reaching into the loop's internals."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from ddp_accel.run_folder import RunFolder
from ddp_accel.state import TrainState

Evaluation = Callable[[str], dict[str, Any]]  # prefix -> the eval loader's metrics of the model's current weights
Activity = Callable[[str], contextlib.AbstractContextManager[Any]]  # what -> a stretch the watchdog bounds generously


@dataclass
class RunContext:
    """One run, as its callbacks see it. `state` is the run's own TrainState (it moves as training does);
    `model` and `optimizer` are the prepared ones (DDP- or FSDP-wrapped); `total_steps` is this command's length in
    its optimizer steps; `resumed_from` the checkpoint it continued (None for a new run)."""

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state: TrainState
    folder: RunFolder
    total_steps: int
    hyperparameters: dict[str, Any]
    exported: Callable[[], torch.nn.Module]
    evaluation: Evaluation
    activity: Activity
    resumed_from: Path | None = None

    def exported_model(self) -> torch.nn.Module:
        """The model whose weights users read (no DDP `module.`, no compile wrapper); the prepared one under FSDP."""
        return self.exported()

    def evaluate(self, prefix: str) -> dict[str, Any]:
        """The eval loader's metrics (`{prefix}_*`) of the model's weights as they are now (a preemption stops it
        like any evaluation)."""
        return self.evaluation(prefix)

    @contextlib.contextmanager
    def slow_on_main(self, what: str, happens: bool = True) -> Iterator[None]:
        """Work that may take long on the main process only (a tracker server, a file on a slow disk): every rank
        waits for it under the watchdog's generous bound, not in the next step's all-reduce under the short one.
        `happens`: whether there is such work at all (the same on every rank)."""
        with self.activity(what):
            yield
            if happens and self.accelerator.num_processes > 1:
                self.accelerator.wait_for_everyone()
