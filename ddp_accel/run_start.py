"""The start of a run, before its first step: the banner, a run already complete (`committed_run`), and the resume
(`resume`: the checkpoint into the prepared objects, the callbacks and the training state, and what counts steps
moved along when the global batch changed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator

from ddp_accel import allocator, rescue
from ddp_accel.budget import BudgetPlan
from ddp_accel.callbacks import Callbacks
from ddp_accel.checkpoint import Checkpoints
from ddp_accel.config import TrainConfig
from ddp_accel.context import RunContext
from ddp_accel.optim import describe_optimizer
from ddp_accel.run_folder import RunFolder
from ddp_accel.run_setup import Prepared
from ddp_accel.runtime import ddp_options, print_banner
from ddp_accel.schedules import move_to_step
from ddp_accel.sharding import sharding_summary
from ddp_accel.state import Rebase, RunIdentity, TrainState
from ddp_accel.stopping import Phase, StopSignals
from ddp_accel.task import RunRecord


class StartingRun(Protocol):
    """What the start reads and sets of a run (ddp_accel.training.TrainingRun is one)."""

    accelerator: Accelerator
    config: TrainConfig
    record: RunRecord
    signals: StopSignals
    folder: RunFolder
    checkpoints: Checkpoints
    state: TrainState
    identity: RunIdentity
    prepared: Prepared
    optimizer: torch.optim.Optimizer
    scheduler: Any
    callbacks: Callbacks
    context: RunContext
    budget: BudgetPlan | None
    budget_kept: bool
    best_metric: str | None
    total_steps: int
    resumed_from: Path | None


def print_run_banner(run: StartingRun) -> None:
    budget = run.budget.describe() if run.budget else None
    if budget and run.budget_kept:
        budget += " (the run's plan, kept: a resume plans nothing)"
    prepared = run.prepared
    print_banner(
        run.accelerator,
        run.record.title,
        batch_size=prepared.micro_batch,
        accumulation=prepared.accumulation,
        steps_per_epoch=prepared.steps_per_epoch,
        total_steps=run.total_steps,
        mixed_precision_asked=run.config.mixed_precision,
        optimizer=describe_optimizer(run.optimizer),
        **prepared.epoch_padding(run.accelerator.num_processes),
        **run.record.banner,
        **({"sharding": shards.describe()} if (shards := sharding_summary(run.accelerator, prepared.model)) else {}),
        **(
            {"ddp_comm_hook": hook}
            if (hook := ddp_options(run.config).describe(run.total_steps, prepared.powersgd))
            else {}
        ),
        **({"time_budget": budget} if budget else {}),
        **({"allocator": kept} if (kept := allocator.describe()) else {}),
        **({"a_lost_peer": lost} if (lost := rescue.describe(run.accelerator, run.checkpoints.contents)) else {}),
        **({"checkpointing": run.checkpoints.auto.describe()} if run.checkpoints.auto else {}),
    )


def committed_run(run: StartingRun) -> dict[str, Any] | None:
    """A run whose artifacts were committed as far as this command asks for (in epochs and samples, whatever the
    world size), under the same identity, is complete: `--resume-from-checkpoint latest` changes nothing. Returns its
    metrics, having said so."""
    if run.config.resume_from_checkpoint != "latest":
        return None
    epochs, steps = divmod(run.total_steps, run.prepared.steps_per_epoch)
    target = (epochs, steps * run.prepared.accumulation * run.state.global_batch)
    complete = run.folder.completion(
        target,
        run.total_steps,
        run.identity.identity,
        bool(run.config.early_stopping_patience),
        bool(run.checkpoints.complete()),
        bool(run.config.time_budget),
    )
    if complete is None:
        return None
    run.accelerator.print(complete[1])
    run.signals.enter(Phase.DONE)
    return complete[0]


def resume(run: StartingRun) -> None:
    """Load `--resume-from-checkpoint` (if any) into the prepared objects, the callbacks and `state`."""
    state, prepared = run.state, run.prepared
    state.training_options = run.config.changeable_options()
    path = run.checkpoints.resume(
        run.config.resume_from_checkpoint,
        state,
        run.identity,
        len(prepared.train_loader),
        prepared.accumulation,
        run.total_steps,
    )
    if path is not None:
        say_changed_options(run, path)
        run.resumed_from = run.context.resumed_from = path
        run.signals.resume_hint = resume_hint(path)
        rebase = run.checkpoints.rebase
        if rebase is not None and rebase.recounted:
            follow_the_recount(run, rebase)
        if state.out_of_time and not run.config.time_budget:
            run.accelerator.print("the checkpoint was where --time-budget ended the run; without it, training goes on")
            state.out_of_time = False
        if state.stopped_early and not run.config.early_stopping_patience:
            run.accelerator.print("the checkpoint was where early stopping ended the run; without it, training goes on")
            state.stopped_early, state.evaluations_without_improvement = False, 0
    saved_metric = state.switch_best_metric(run.best_metric)
    if saved_metric is not None:
        run.accelerator.print(
            f"warning: the checkpoint's best so far was by {saved_metric}, this run's by {run.best_metric}: the best "
            "model and early stopping start again from here (model_best.safetensors is replaced at the next "
            "evaluation)"
        )


def say_changed_options(run: StartingRun, path: Path) -> None:
    """The options a resume may change (config.CHANGEABLE_AT_RESUME) that it did: one line; the run goes on with
    this command's values (a checkpoint of an earlier version records none)."""
    saved, now = run.state.training_options, run.config.changeable_options()
    changed = [
        f"--{key.replace('_', '-')} {saved[key]} -> {now[key]}"
        for key in now
        if key in saved and saved[key] != now[key] and now[key] is not None  # (an option now unused: its own line)
    ]
    if changed:
        run.accelerator.print(
            f"warning: {path} was trained with other options: {', '.join(changed)}; the run goes on with this "
            "command's (the weights and the optimizer's state fit them)"
        )
    run.state.training_options = now


def follow_the_recount(run: StartingRun, rebase: Rebase) -> None:
    """Steps are counted again in this command's steps: the LR schedule's position (its length already is) and
    whatever the callbacks count in steps move to the same place in the data."""
    if run.scheduler is not None and not move_to_step(run.scheduler, run.state.step):
        inner = getattr(run.scheduler, "scheduler", run.scheduler)
        run.accelerator.print(
            f"warning: the LR scheduler {type(inner).__name__} cannot be moved to step {run.state.step} (its rate is "
            f"not a formula of the step): it goes on from the checkpoint's step {rebase.saved_step}"
        )
    run.callbacks.call("on_rebase", run.context, rebase)


def resume_hint(path: Path) -> str:
    return f"The newest checkpoint is {path}; to continue, run the same command with --resume-from-checkpoint latest."
