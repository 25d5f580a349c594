"""What `fit` is given, as typed objects: the task to train (`Task`) and what the run records about itself
(`RunRecord`). A new feature adds a field here or a callback (ddp_accel.callbacks), not a keyword to fit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]  # (model, batch) -> mean loss of the batch
EvalFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]  # (model, batch) -> per-sample values
MetricsFn = Callable[[dict[str, torch.Tensor]], dict[str, Any]]  # all samples' values -> metrics
# (optimizer, total optimizer steps, optimizer steps per epoch) -> LR scheduler stepped once per optimizer step
SchedulerFn = Callable[[torch.optim.Optimizer, int, int], Any]


@dataclass
class Task:
    """What to train and how to measure it. `fit` prepares the model, optimizer and loaders with the Accelerator.

    - `loss_fn(model, batch)`: the mean loss of a batch;
    - `eval_loader` is evaluated every epoch (and every `--eval-steps`), `test_loader` once after training;
    - `eval_fn(model, batch)`: per-sample values, gathered over ranks; `metrics_fn(values)`: the metrics from all
      of them (default: the mean of each);
    - `make_scheduler(optimizer, total_steps, steps_per_epoch)`: stepped once per optimizer step;
    - `best_metric`: the evaluation metric (higher is better) that picks model_best.safetensors;
    - `metric_names`: the numbers the evaluation reports, without their `eval_` prefix (e.g. `loss`, `accuracy`;
      `ddp_accel.metrics.classification_names`): --best-metric is checked against them before the first step
      (without them, at the first evaluation).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: Any
    loss_fn: LossFn
    eval_loader: Any = None
    eval_fn: EvalFn | None = None
    metrics_fn: MetricsFn | None = None
    test_loader: Any = None
    make_scheduler: SchedulerFn | None = None
    best_metric: str | None = None
    metric_names: tuple[str, ...] = ()


@dataclass
class RunRecord:
    """What the run says about itself: `title` (banner, curves), `banner` (extra lines of the start-up banner),
    `extra_metrics` (added to metrics.json), `artifacts` (name -> file copied into the output dir at the commit),
    `identity` (ddp_accel.make_identity: what must match for a resume)."""

    title: str = "ddp_accel"
    banner: dict[str, Any] = field(default_factory=dict)
    extra_metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Path] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)
