"""What `fit` builds before its first step, each from the options and the script's `Task`: the prepared objects
(`prepare_task`: --auto-batch-size, --compile, Accelerate's prepare), the options checked against what the script
gives, the LR scheduler, the run's own features as callbacks, and --time-budget's plan."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ddp_accel.bad_samples import SkippingBadSamples
from ddp_accel.batch_size import find_micro_batch, with_batch_size
from ddp_accel.budget import BudgetGuard, BudgetPlan, RunShape, Timing, budget_line, epochs_text, plan_run
from ddp_accel.callback_state import CallbackStates
from ddp_accel.callbacks import BestModel, Callback, EarlyStopping, ProgressBar, Trackers
from ddp_accel.checkpoint_format import AcceleratorObjects, Contents
from ddp_accel.comm_hooks import PowerSGD, PowerSGDStates, check_model, register_powersgd
from ddp_accel.config import (
    AveragingOptions,
    EvaluationOptions,
    ScheduleOptions,
    TrackingOptions,
    TrainConfig,
    WatchdogOptions,
    check_evaluation,
    check_strategy,
)
from ddp_accel.ema import WeightAverage
from ddp_accel.errors import UserError
from ddp_accel.loaders import exit_now
from ddp_accel.profiling import ProfilerWindow
from ddp_accel.run_folder import RunFolder
from ddp_accel.runtime import built_ddp_options, shards_weights, topology
from ddp_accel.schedules import PlateauFeed, make_schedule
from ddp_accel.sharding import before_prepare
from ddp_accel.stopping import StopSignals
from ddp_accel.task import Task
from ddp_accel.watchdog import ProgressWatchdog


def epoch_samples(loader: Any) -> int:
    """The samples of an epoch: the training set's length (0 for a dataset without one)."""
    try:
        return len(loader.dataset)
    except TypeError:
        return 0


def padded_samples(epoch_samples: int, per_round: int, processes: int) -> int:
    """The samples an epoch's last round repeats to fill every process's batch (none on one process, whose last
    batch is short instead)."""
    return -epoch_samples % per_round if epoch_samples and processes > 1 else 0


def seed_loader_generators(seed: int, *loaders_: Any) -> None:
    """Creating a DataLoader iterator draws a worker seed from the global RNG unless the loader has a generator
    of its own. On a mid-epoch resume that draw would land after the restored RNG state (at epoch start in the
    uninterrupted run), and dropout masks would differ after the resume."""
    for loader in loaders_:
        if loader is not None and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(seed)


@dataclass
class Prepared:
    """The objects fit trains with, prepared by the Accelerator, and the batch they were prepared for."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: Any
    eval_loader: Any
    test_loader: Any
    micro_batch: int  # per process (--auto-batch-size may have chosen a divisor of --batch-size)
    accumulation: int
    epoch_samples: int
    powersgd: list[PowerSGD] = field(default_factory=list)  # --ddp-comm-hook powersgd's hook, with its state

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_loader) / self.accumulation)

    def epoch_padding(self, processes: int) -> dict[str, str]:
        """On several processes an epoch's last round is filled up with samples from its start (Accelerate's
        even_batches), so that every process steps together: said in the banner, as it makes 1 x 2B and 2 x B
        differ in each epoch's last step."""
        per_round = self.micro_batch * processes
        padding = padded_samples(self.epoch_samples, per_round, processes)
        if not padding:
            return {}
        return {"epoch_padding": f"{padding} samples seen twice per epoch (the last round of {per_round})"}

    def trained_metrics(self, accelerator: Accelerator, config: TrainConfig) -> dict[str, Any]:
        """metrics.json's figures of what trained: where the schedule ended (a plateau's decays), the topology, the
        batch --auto-batch-size chose."""
        asked = {"auto_batch_size": f"{config.batch_size} asked, {self.micro_batch} fits"}
        return {
            "final_lr": self.optimizer.param_groups[0]["lr"],
            **topology(accelerator, self.micro_batch, self.accumulation),
            **(asked if config.auto_batch_size else {}),
        }


def prepare_task(accelerator: Accelerator, config: TrainConfig, task: Task) -> Prepared:
    """--auto-batch-size (before prepare: the loader is rebuilt with the size that fits, the global batch kept by
    more accumulation), the loaders' own generators, --compile in place, then Accelerate's prepare. The task
    itself is not changed."""
    micro_batch, accumulation, train_loader = config.batch_size, config.gradient_accumulation_steps, task.train_loader
    if config.auto_batch_size:
        micro_batch = find_micro_batch(accelerator, task.model, task.loss_fn, train_loader, config.batch_size)
        if micro_batch != config.batch_size:
            train_loader = with_batch_size(train_loader, micro_batch)
            accumulation *= config.batch_size // micro_batch
            accelerator.gradient_accumulation_steps = accumulation
    seed_loader_generators(config.seed, train_loader, task.eval_loader, task.test_loader)
    if config.compile:  # in place: the module, its class and its state dict's names stay what they were
        mode = None if config.compile == "default" or config.compile_backend != "inductor" else config.compile
        task.model.compile(mode=mode, backend=config.compile_backend)
    before_prepare(accelerator, task.model)  # under FSDP2's bf16: BatchNorm in fp32
    check_model(task.model, config.ddp_comm_hook)
    model, optimizer, prepared_train = accelerator.prepare(task.model, task.optimizer, train_loader)
    eval_loader = accelerator.prepare(task.eval_loader) if task.eval_loader is not None else None
    test_loader = accelerator.prepare(task.test_loader) if task.test_loader is not None else None
    samples = epoch_samples(train_loader)
    prepared = Prepared(model, optimizer, prepared_train, eval_loader, test_loader, micro_batch, accumulation, samples)
    prepared.powersgd = register_powersgd(
        model, built_ddp_options(accelerator, config)
    )  # its state goes into the checkpoints
    return prepared


def check_options_against_task(
    accelerator: Accelerator, config: TrainConfig, task: Task, best_metric: str | None
) -> None:
    """The options that depend on what the script gives fit (its metrics, an evaluation loader) and on the
    strategy the accelerate config chose (FSDP's version, DeepSpeed)."""
    check_evaluation(config, best_metric, task.eval_loader is not None, tuple(task.metric_names))
    kind = accelerator.distributed_type
    fsdp_version = accelerator.state.fsdp_plugin.fsdp_version if kind == DistributedType.FSDP else None
    check_strategy(config, shards_weights(accelerator), kind == DistributedType.DEEPSPEED, fsdp_version)
    if config.skip_bad_samples and not isinstance(getattr(task.train_loader, "dataset", None), SkippingBadSamples):
        raise UserError(
            f"--skip-bad-samples {config.skip_bad_samples}: this script's training loader does not read its samples "
            "through run.skipping_bad_samples(dataset), so none would be skipped"
        )


def progress_watchdog(folder: RunFolder, rank: int, options: WatchdogOptions, signals: StopSignals) -> ProgressWatchdog:
    """The run's watchdog (--hang-timeout-s): it reports the run's phase, and exits with the helpers ended."""
    return ProgressWatchdog(folder.path, rank, options.hang_timeout_s, phase=lambda: signals.phase, exit=exit_now)


def checkpoint_contents(task: Task, prepared: Prepared, scheduler: Any, callbacks: list[Callback]) -> Contents:
    """What the run's checkpoints hold: the state of what it handed Accelerate's prepare, in its order (the model
    as handed over: Accelerate saves it, not its DDP wrapper; the rest as prepared), the stateful callbacks' states
    by key, each rank's PowerSGD state."""
    loaders = [prepared.train_loader, prepared.eval_loader, prepared.test_loader]
    objects = AcceleratorObjects(
        [task.model],
        [prepared.optimizer],
        [scheduler] if scheduler is not None else [],
        [loader for loader in loaders if loader is not None],
    )
    return Contents(objects, [CallbackStates(callbacks), PowerSGDStates(prepared.powersgd)])


def build_scheduler(
    accelerator: Accelerator,
    options: ScheduleOptions,
    task: Task,
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    steps_per_epoch: int,
    best_metric: str | None,
) -> tuple[Any, list[Callback]]:
    """The shared --lr-schedule (it replaces the script's own), else the script's, prepared; and the plateau
    schedule's feed of evaluations."""
    scheduler: Any = None
    feed: list[Callback] = []
    if options.lr_schedule:
        scheduler, schedule = make_schedule(options, optimizer, total_steps, steps_per_epoch)
        if options.lr_schedule == "plateau" and best_metric:
            feed.append(PlateauFeed(schedule, best_metric))
    elif task.make_scheduler:
        scheduler = task.make_scheduler(optimizer, total_steps, steps_per_epoch)
    return (accelerator.prepare(scheduler) if scheduler is not None else None), feed


@dataclass
class Features:
    """fit's own features as callbacks, in the order they are called: the progress bar and trackers, the weights'
    average, the best model, the profiler window, the plateau schedule, the script's callbacks, early stopping
    (last: it counts an evaluation the others have seen)."""

    ema: WeightAverage | None
    callbacks: list[Callback]


def standard_callbacks(
    averaging: AveragingOptions,
    evaluation: EvaluationOptions,
    tracking: TrackingOptions,
    best_metric: str | None,
    total_steps: int,
    length_chosen_by: str,
    given: list[Callback],
) -> Features:
    ema = WeightAverage(averaging.ema_decay, averaging.ema_warmup) if averaging.ema_decay else None
    profiler = [ProfilerWindow(*tracking.profile_steps)] if tracking.profile_steps else []  # off: no callback
    for window in profiler:
        window.check(total_steps, length_chosen_by)
    early = (
        [EarlyStopping(best_metric, evaluation.early_stopping_patience, evaluation.early_stopping_min_delta)]
        if evaluation.early_stopping_patience and best_metric
        else []
    )
    average = [ema] if ema else []
    return Features(ema, [ProgressBar(), Trackers(), *average, BestModel(best_metric, ema), *profiler, *given, *early])


@dataclass(frozen=True)
class RunLength:
    """How long the run trains: its epochs and optimizer steps, and --time-budget's plan that chose them."""

    epochs: int
    total_steps: int
    started: float  # when the command started: --time-budget's clock
    budget: BudgetPlan | None = None
    budget_kept: bool = False  # the plan the run made at its start, kept by a resume

    def banner(self) -> str | None:
        if self.budget is None:
            return None
        return self.budget.describe() + (" (the run's plan, kept: a resume plans nothing)" if self.budget_kept else "")

    def guard(self) -> tuple[str, list[Callback]]:
        """The progress bar's note on the epochs, and the callback that keeps the budget (a resume's too)."""
        if self.budget is None:
            return "", []
        return f" ({epochs_text(self.epochs)}: --time-budget's plan)", [BudgetGuard(self.budget, self.started)]

    def budget_metrics(self, now: float) -> dict[str, Any]:
        """metrics.json's time_budget: the plan and the command's time."""
        if self.budget is None:
            return {}
        return {"time_budget": {**self.budget.state_dict(), "command_s": round(now - self.started, 1)}}

    def end_line(self, now: float, resumed: bool) -> str | None:
        return budget_line(self.budget, now - self.started, resumed) if self.budget is not None else None


def run_length(
    accelerator: Accelerator,
    config: TrainConfig,
    task: Task,
    prepared: Prepared,
    folder: RunFolder,
    started: float,
    train_batch: Callable[[Any], Any],
) -> RunLength:
    """--epochs and --max-steps, or --time-budget's plan (at most --epochs, from batches timed through the loop's
    own `train_batch`)."""
    budget, kept = None, False
    if config.time_budget:
        budget, kept = plan_time_budget(accelerator, config, task, prepared, folder, started, train_batch)
    epochs = budget.epochs if budget else config.epochs
    total_steps = int(min(epochs * prepared.steps_per_epoch, config.max_steps or math.inf))
    return RunLength(epochs, total_steps, started, budget, kept)


def plan_time_budget(
    accelerator: Accelerator,
    config: TrainConfig,
    task: Task,
    prepared: Prepared,
    folder: RunFolder,
    started: float,
    train_batch: Callable[[Any], Any],
) -> tuple[BudgetPlan, bool]:
    """--time-budget: the plan the run made at its start (kept by a resume, or a rerun of the complete run), else
    a new one from batches timed here on the prepared objects. Returns (plan, kept?)."""
    kept_state, trained_without = folder.listing.saved_plan(config.resume_from_checkpoint)
    if kept_state is None and trained_without is None and config.resume_from_checkpoint == "latest":
        kept_state = (folder.read_committed() or {}).get("time_budget")  # a rerun of the complete run
    try:
        kept = BudgetPlan.from_state(kept_state) if kept_state else None
    except (KeyError, TypeError, ValueError):  # unreadable: planned again
        kept = None
    eval_loader = prepared.eval_loader if prepared.eval_loader is not None else prepared.test_loader
    timing = Timing(
        accelerator,
        train_batch,
        prepared.model,
        prepared.optimizer,
        prepared.train_loader,
        task.eval_fn,
        eval_loader,
        prepared.accumulation,
        started,
    )
    steps_per_epoch = prepared.steps_per_epoch
    most = -(-config.max_steps // steps_per_epoch) if config.max_steps else config.epochs
    shape = RunShape(
        batches_per_epoch=len(prepared.train_loader),
        max_epochs=min(config.epochs, most),
        eval_batches=len(prepared.eval_loader) if prepared.eval_loader is not None else 0,
        evaluations_per_eval=2 if config.ema_decay else 1,  # the raw weights and their average
        eval_every_epochs=config.eval_every_epochs,
        eval_every_steps=config.eval_steps,
        steps_per_epoch=steps_per_epoch,
        test_batches=len(prepared.test_loader) if prepared.test_loader is not None else 0,
    )
    return plan_run(config, kept, trained_without, timing, shape)
