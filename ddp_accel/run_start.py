"""The start of a run, before its first step: the banner, a run already complete (`committed_run`), and the resume
(`load_checkpoint`: the checkpoint into the prepared objects, the callbacks and the training state; `move_the_schedule`
when the global batch changed what counts steps). Each takes what it reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator

from ddp_accel import allocator, rescue
from ddp_accel.checkpoint import Checkpoints
from ddp_accel.config import TrainConfig
from ddp_accel.optim import describe_optimizer
from ddp_accel.run_folder import RunFolder
from ddp_accel.run_setup import Prepared
from ddp_accel.runtime import built_ddp_options, print_banner
from ddp_accel.schedules import move_to_step
from ddp_accel.sharding import sharding_summary
from ddp_accel.state import Rebase, RunIdentity, TrainState
from ddp_accel.task import RunRecord


def print_run_banner(
    accelerator: Accelerator,
    config: TrainConfig,
    record: RunRecord,
    prepared: Prepared,
    total_steps: int,
    checkpoints: Checkpoints,
    budget: str | None,
) -> None:
    print_banner(
        accelerator,
        record.title,
        batch_size=prepared.micro_batch,
        accumulation=prepared.accumulation,
        steps_per_epoch=prepared.steps_per_epoch,
        total_steps=total_steps,
        mixed_precision_asked=config.mixed_precision,
        optimizer=describe_optimizer(prepared.optimizer),
        **prepared.epoch_padding(accelerator.num_processes),
        **record.banner,
        **({"sharding": shards.describe()} if (shards := sharding_summary(accelerator, prepared.model)) else {}),
        **(
            {"ddp_comm_hook": hook}
            if (hook := built_ddp_options(accelerator, config).describe(total_steps, prepared.powersgd))
            else {}
        ),
        **(
            {"gradients": f"pieces of {exact} samples added in the global batch's order: bitwise at any world size"}
            if (exact := config.communication.exact_micro_batch)
            else {}
        ),
        **({"time_budget": budget} if budget else {}),
        **({"allocator": kept} if (kept := allocator.describe()) else {}),
        **({"a_lost_peer": lost} if (lost := rescue.describe(accelerator, checkpoints.contents)) else {}),
        **({"checkpointing": checkpoints.auto.describe()} if checkpoints.auto else {}),
    )


def committed_run(
    accelerator: Accelerator,
    config: TrainConfig,
    folder: RunFolder,
    identity: RunIdentity,
    total_steps: int,
    prepared: Prepared,
    state: TrainState,
) -> dict[str, Any] | None:
    """A run whose artifacts were committed as far as this command asks for (in epochs and samples, whatever the
    world size), under the same identity, is complete: `--resume-from-checkpoint latest` changes nothing. Returns its
    metrics, having said so."""
    if config.resume_from_checkpoint != "latest":
        return None
    epochs, steps = divmod(total_steps, prepared.steps_per_epoch)
    complete = folder.completion(
        (epochs, steps * prepared.accumulation * state.global_batch),
        total_steps,
        identity.identity,
        bool(config.early_stopping_patience),
        bool(folder.listing.complete()),
        bool(config.time_budget),
    )
    if complete is None:
        return None
    accelerator.print(complete[1])
    return complete[0]


def load_checkpoint(
    accelerator: Accelerator,
    config: TrainConfig,
    checkpoints: Checkpoints,
    state: TrainState,
    identity: RunIdentity,
    prepared: Prepared,
    total_steps: int,
) -> Path | None:
    """Load `--resume-from-checkpoint` (if any) into the prepared objects, the callbacks and `state`; returns its
    path. The options it changed, and the ends it no longer holds to (--time-budget, early stopping), are said."""
    state.training_options = config.changeable_options()
    path = checkpoints.resume(
        config.resume_from_checkpoint,
        state,
        identity,
        len(prepared.train_loader),
        prepared.accumulation,
        total_steps,
    )
    if path is None:
        return None
    say_changed_options(accelerator, config, state, path)
    if state.out_of_time and not config.time_budget:
        accelerator.print("the checkpoint was where --time-budget ended the run; without it, training goes on")
        state.out_of_time = False
    if state.stopped_early and not config.early_stopping_patience:
        accelerator.print("the checkpoint was where early stopping ended the run; without it, training goes on")
        state.stopped_early, state.evaluations_without_improvement = False, 0
    return path


def say_changed_options(accelerator: Accelerator, config: TrainConfig, state: TrainState, path: Path) -> None:
    """The options a resume may change (config.CHANGEABLE_AT_RESUME) that it did: one line; the run goes on with
    this command's values (a checkpoint of an earlier version records none)."""
    saved, now = state.training_options, config.changeable_options()
    changed = [
        f"--{key.replace('_', '-')} {saved[key]} -> {now[key]}"
        for key in now
        if key in saved and saved[key] != now[key] and now[key] is not None  # (an option now unused: its own line)
    ]
    if changed:
        accelerator.print(
            f"warning: {path} was trained with other options: {', '.join(changed)}; the run goes on with this "
            "command's (the weights and the optimizer's state fit them)"
        )
    state.training_options = now


def move_the_schedule(accelerator: Accelerator, scheduler: Any, step: int, rebase: Rebase) -> None:
    """Steps are counted again in this command's steps: the LR schedule moves to the same place in the data (its
    length already is this command's), or a line says why it cannot."""
    if scheduler is not None and not move_to_step(scheduler, step):
        inner = getattr(scheduler, "scheduler", scheduler)
        accelerator.print(
            f"warning: the LR scheduler {type(inner).__name__} cannot be moved to step {step} (its rate is "
            f"not a formula of the step): it goes on from the checkpoint's step {rebase.saved_step}"
        )


def switch_best_metric(accelerator: Accelerator, state: TrainState, best_metric: str | None) -> None:
    """A checkpoint whose best so far was by another metric: the best model and early stopping start again."""
    saved_metric = state.switch_best_metric(best_metric)
    if saved_metric is not None:
        accelerator.print(
            f"warning: the checkpoint's best so far was by {saved_metric}, this run's by {best_metric}: the best "
            "model and early stopping start again from here (model_best.safetensors is replaced at the next "
            "evaluation)"
        )


def resume_hint(path: Path) -> str:
    return f"The newest checkpoint is {path}; to continue, run the same command with --resume-from-checkpoint latest."
