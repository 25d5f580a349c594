"""The one training loop every script uses: `fit`, and the run it drives (`TrainingRun`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ddp_accel import loaders
from ddp_accel.batch_size import find_micro_batch, with_batch_size
from ddp_accel.budget import BudgetPlan, check_plan, command_started, epochs_text, measure_costs, plan_epochs
from ddp_accel.callbacks import BestModel, Callback, Callbacks, ProgressBar, Trackers
from ddp_accel.checkpoint import (
    Checkpoints,
    model_fingerprint,
    optimizer_fingerprint,
    read_training_state,
    resolve_resume,
)
from ddp_accel.cli import format_duration
from ddp_accel.config import TrainConfig, every
from ddp_accel.ema import WeightAverage
from ddp_accel.errors import UserError
from ddp_accel.evaluation import evaluate
from ddp_accel.files import write_json, writing
from ddp_accel.meters import EvalHistory, improves, numbers
from ddp_accel.optim import describe_optimizer
from ddp_accel.plots import plot_history
from ddp_accel.profiling import ProfilerWindow
from ddp_accel.run_folder import RunFolder, ended_by_early_stopping
from ddp_accel.runtime import lost_peers, print_banner, topology
from ddp_accel.schedules import PlateauFeed, check_schedule, make_schedule, move_to_step
from ddp_accel.state import Rebase, RunIdentity, TrainState
from ddp_accel.stopping import Phase, Preempted, SaveGrace, StepAgreement, StopFacts, StopSignals, Verdict
from ddp_accel.task import RunRecord, Task
from ddp_accel.train_step import TrainStep
from ddp_accel.watchdog import ProgressWatchdog


class StopTraining(Exception):
    """The ranks agreed to stop (a preemption signal, or a loss that is not finite)."""

    def __init__(self, verdict: Verdict):
        super().__init__(str(verdict))
        self.verdict = verdict


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


class TrainingRun:
    """One call of fit(): the prepared objects, where training is (`state`) and who the run is (`identity`), its
    folder and checkpoints, the meters, and the steps of the loop. fit() reads as the loop; the steps are here."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: TrainConfig,
        task: Task,
        record: RunRecord,
        signals: StopSignals,
        callbacks: Sequence[Callback] = (),
    ):
        self.accelerator, self.config, self.task, self.record, self.signals = accelerator, config, task, record, signals
        self.folder = RunFolder(config.output_dir)
        self.checkpoints = Checkpoints(
            accelerator, self.folder.checkpoints, config.checkpointing_steps, config.checkpoint_limit
        )
        self.identity = RunIdentity(
            model_fingerprint(task.model), record.identity, optimizer_fingerprint(task.optimizer)
        )
        self.micro_batch, self.accumulation = config.batch_size, config.gradient_accumulation_steps
        if config.auto_batch_size:  # before prepare: the loader is rebuilt with the size that fits
            self.micro_batch = find_micro_batch(
                accelerator, task.model, task.loss_fn, task.train_loader, config.batch_size
            )
            if self.micro_batch != config.batch_size:
                task.train_loader = with_batch_size(task.train_loader, self.micro_batch)
                self.accumulation *= config.batch_size // self.micro_batch
                accelerator.gradient_accumulation_steps = self.accumulation
        self.state = TrainState(
            global_batch=self.micro_batch * accelerator.num_processes,
            world_size=accelerator.num_processes,
            epoch_samples=epoch_samples(task.train_loader),
        )
        seed_loader_generators(config.seed, task.train_loader, task.eval_loader, task.test_loader)
        if config.compile:  # in place: the module, its class and its state dict's names stay what they were
            mode = None if config.compile == "default" or config.compile_backend != "inductor" else config.compile
            task.model.compile(mode=mode, backend=config.compile_backend)
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.model, self.optimizer, self.train_loader = accelerator.prepare(
            task.model, task.optimizer, task.train_loader
        )
        self.eval_loader: Any = accelerator.prepare(task.eval_loader) if task.eval_loader is not None else None
        self.test_loader: Any = accelerator.prepare(task.test_loader) if task.test_loader is not None else None
        self.steps_per_epoch = math.ceil(len(self.train_loader) / self.accumulation)
        self.best_metric = config.best_metric or task.best_metric  # --best-metric, else the script's
        if config.lr_schedule:
            check_schedule(config, self.best_metric, task.eval_loader is not None)
        if config.early_stopping_patience and (task.eval_loader is None or not self.best_metric):
            raise UserError(
                "--early-stopping-patience needs an evaluation to watch: an eval loader and a metric (--best-metric, "
                "e.g. eval_loss)"
            )
        self.ema = WeightAverage(config.ema_decay, config.ema_warmup) if config.ema_decay else None
        if self.ema is not None and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise UserError("--ema-decay averages whole weights on every rank: not with FSDP or DeepSpeed shards")
        if self.best_metric and self.best_metric.startswith("ema_") and self.ema is None:
            raise UserError(f"--best-metric {self.best_metric} is a metric of the weights' average: add --ema-decay")
        self.started = command_started(time.time())  # --time-budget's clock
        self.budget, self.budget_kept = None, False
        if config.time_budget:  # settles --epochs before anything reads it
            self.budget = self.plan_time_budget()
            config = self.config = dataclasses.replace(config, epochs=self.budget.epochs)
            self.state.time_budget = self.budget.state_dict()
        self.total_steps = int(min(config.epochs * self.steps_per_epoch, config.max_steps or math.inf))
        schedule_feed: list[Callback] = []
        scheduler: Any = None
        if config.lr_schedule:  # the shared schedule replaces the script's own
            scheduler, schedule = make_schedule(config, self.optimizer, self.total_steps, self.steps_per_epoch)
            if config.lr_schedule == "plateau" and self.best_metric:
                schedule_feed.append(PlateauFeed(schedule, self.best_metric))
        elif task.make_scheduler:
            scheduler = task.make_scheduler(self.optimizer, self.total_steps, self.steps_per_epoch)
        self.scheduler: Any = accelerator.prepare(scheduler) if scheduler is not None else None
        profiler = [ProfilerWindow(*config.profile_steps)] if config.profile_steps else []  # off: no callback
        for window in profiler:
            window.check(
                self.total_steps, f" ({epochs_text(config.epochs)}: --time-budget's plan)" if self.budget else ""
            )
        self.callbacks = Callbacks(
            [ProgressBar(), Trackers(), *([self.ema] if self.ema else []), BestModel(self.best_metric), *profiler]
            + schedule_feed
            + list(callbacks)
        )
        self.agreement = StepAgreement(accelerator)
        self.step = TrainStep(
            accelerator, self.model, self.optimizer, task.loss_fn, config.max_grad_norm, self.agreement
        )
        self.history = EvalHistory(self.folder.path / "history.json")
        self.test_metrics: dict[str, Any] = {}
        self.resumed_from: Path | None = None
        self.wall_start = time.perf_counter()
        self.grace = SaveGrace(accelerator.is_main_process)
        self.watchdog = ProgressWatchdog(
            self.folder.path, accelerator.process_index, config.hang_timeout_s, phase=lambda: self.signals.phase
        )

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.watchdog.stop()
        self.callbacks.on_close(self)
        self.folder.release()  # the output dir, to the next run

    # --- start: every check first, then the first writes ---
    def start(self) -> dict[str, Any] | None:
        """Resume (or not), check the output dir; returns the committed metrics when the run is already complete."""
        print_banner(
            self.accelerator,
            self.record.title,
            batch_size=self.micro_batch,
            accumulation=self.accumulation,
            steps_per_epoch=self.steps_per_epoch,
            total_steps=self.total_steps,
            mixed_precision_asked=self.config.mixed_precision,
            optimizer=describe_optimizer(self.optimizer),
            **self.epoch_padding(),
            **self.record.banner,
            **({"time_budget": self.describe_budget()} if self.budget else {}),
        )
        complete = self.committed_run()
        if complete is not None:
            return complete
        config = self.config
        self.folder.check(config.resume_from_checkpoint, config.overwrite_output_dir, bool(self.checkpoints.complete()))
        for callback in self.callbacks.stateful():  # saved with the model and optimizer, restored by the resume
            self.accelerator.register_for_checkpointing(callback)
        self.resume()
        if self.accelerator.is_main_process:
            self.folder.lock()
            if config.overwrite_output_dir and self.resumed_from is None:
                self.folder.clear_previous_run()
        if self.resumed_from is not None:
            # the place the checkpoint saved, before a resize rounded it down to this command's batches
            saved = self.state.samples_trained + self.checkpoints.leftover
            self.history.keep_until(saved, self.state.step)
            if self.state.last_eval_step < 0 and self.history.records:
                # a checkpoint of an earlier version does not record its last evaluation: history.json does
                last = self.history.records[-1]
                at_place = last.get("samples") == saved if "samples" in last else last["step"] == self.state.step
                self.state.last_eval_step = self.state.step if at_place else -1
            self.grace.check(StopFacts.last_save_s(self.folder.path))  # the save time of the last stop
        self.signals.enter(Phase.TRAIN)
        self.callbacks.on_start(self)
        self.watchdog.start()
        return None

    def plan_time_budget(self) -> BudgetPlan:
        """--time-budget: the plan the run made at its start (kept by a resume, or a rerun of the complete run),
        else a new one from batches timed here."""
        config, accelerator, task = self.config, self.accelerator, self.task
        assert config.time_budget
        kept, checkpoint = self.saved_plan()
        if kept is not None:
            if abs(kept.budget_s - config.time_budget) > 0.5:
                raise UserError(
                    f"--time-budget {format_duration(config.time_budget)}: the run was planned for "
                    f"{format_duration(kept.budget_s)} ({epochs_text(kept.epochs)}), and a resume keeps its plan: give "
                    f"--time-budget {kept.budget_s:g}s, or --epochs without --time-budget to change its length"
                )
            self.budget_kept = True
            return dataclasses.replace(kept, epochs=min(kept.epochs, config.epochs))  # still at most --epochs
        if checkpoint is not None:
            raise UserError(
                f"--time-budget plans a run from its start, and {checkpoint} was trained without one: resume "
                "without --time-budget (--epochs decides), or start a new run"
            )
        if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise UserError("--time-budget times steps on whole weights: not with FSDP or DeepSpeed (give --epochs)")
        probe = TrainStep(
            accelerator, self.model, self.optimizer, task.loss_fn, config.max_grad_norm, StepAgreement(accelerator)
        )
        eval_loader = self.eval_loader if self.eval_loader is not None else self.test_loader
        accelerator.print(f"--time-budget {format_duration(config.time_budget)}: timing a few batches ...")
        costs = measure_costs(
            accelerator, probe, self.model, self.optimizer, self.train_loader, task.eval_fn, eval_loader,
            self.accumulation, self.started,
        )  # fmt: skip
        plan = plan_epochs(
            config.time_budget,
            costs,
            batches_per_epoch=len(self.train_loader),
            max_epochs=min(
                config.epochs, -(-config.max_steps // self.steps_per_epoch) if config.max_steps else config.epochs
            ),
            eval_batches=len(self.eval_loader) if self.eval_loader is not None else 0,
            evaluations_per_eval=2 if config.ema_decay else 1,  # the raw weights and their average
            eval_every_epochs=config.eval_every_epochs,
            eval_every_steps=config.eval_steps,
            steps_per_epoch=self.steps_per_epoch,
            test_batches=len(self.test_loader) if self.test_loader is not None else 0,
        )
        check_plan(plan, costs.spent_s, config)
        return plan

    def saved_plan(self) -> tuple[BudgetPlan | None, Path | None]:
        """The --time-budget plan of the checkpoint this command resumes (and that checkpoint, when it was trained
        without one), or of the complete run in the folder when there is no checkpoint."""
        resume = self.config.resume_from_checkpoint
        path = resolve_resume(resume, self.folder.checkpoints)  # (its integrity is checked at the resume)
        try:
            if path is not None:
                saved = read_training_state(path)
                return (BudgetPlan.from_state(saved["time_budget"]), None) if saved.get("time_budget") else (None, path)
            committed = self.folder.read_committed() if resume == "latest" else None
            if committed is not None:
                return BudgetPlan.from_state(committed["time_budget"]), None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable: the resume says so
            pass
        return None, None

    def describe_budget(self) -> str:
        assert self.budget is not None
        return self.budget.describe() + (" (the run's plan, kept: a resume plans nothing)" if self.budget_kept else "")

    def epoch_padding(self) -> dict[str, str]:
        """On several processes an epoch's last round is filled up with samples from its start (Accelerate's
        even_batches), so that every process steps together: said in the banner, as it makes 1 x 2B and 2 x B
        differ in each epoch's last step."""
        per_round = self.micro_batch * self.accelerator.num_processes
        padding = padded_samples(self.state.epoch_samples, per_round, self.accelerator.num_processes)
        if not padding:
            return {}
        return {"epoch_padding": f"{padding} samples seen twice per epoch (the last round of {per_round})"}

    def committed_run(self) -> dict[str, Any] | None:
        """A run whose artifacts were committed as far as this command asks for (in epochs and samples, whatever
        the world size), under the same identity, is complete: `--resume-from-checkpoint latest` changes nothing."""
        if self.config.resume_from_checkpoint != "latest":
            return None
        epochs, steps = divmod(self.total_steps, self.steps_per_epoch)
        target = (epochs, steps * self.accumulation * self.state.global_batch)
        early_stopping = bool(self.config.early_stopping_patience)
        committed = self.folder.committed_metrics(target, self.total_steps, self.identity.identity, early_stopping)
        if committed is None:
            return None
        if ended_by_early_stopping(committed):
            how_on = "Without --early-stopping-patience, a larger --epochs or --max-steps"
            ended = f"ended by {committed['end_reason']}"
        else:
            how_on, ended = "A larger --epochs or --max-steps", f"{committed['steps']} steps"
        self.accelerator.print(
            f"the run in {self.folder.path} is complete ({ended}); nothing to do. "
            + (
                f"{how_on} continues it from its newest checkpoint."
                if self.checkpoints.complete()
                else "It kept no checkpoint to continue from (--checkpointing-steps): a longer run starts again, "
                "with --overwrite-output-dir."
            )
        )
        self.signals.enter(Phase.DONE)
        return committed

    def resume(self) -> None:
        """Load `--resume-from-checkpoint` (if any) into the prepared objects and `state`."""
        path = self.checkpoints.resume(
            self.config.resume_from_checkpoint, self.state, self.identity, len(self.train_loader), self.accumulation,
            self.total_steps,
        )  # fmt: skip
        if path is not None:
            self.resumed_from = path
            self.signals.resume_hint = resume_hint(path)
            rebase = self.checkpoints.rebase
            if rebase is not None and rebase.recounted:
                self.follow_the_recount(rebase)
            self.forget_another_metrics_best()
            if self.state.stopped_early and not self.config.early_stopping_patience:
                self.accelerator.print(
                    "the checkpoint was where early stopping ended the run; without it, training goes on"
                )
                self.state.stopped_early, self.state.evaluations_without_improvement = False, 0
        self.state.best_metric_name = self.best_metric

    def follow_the_recount(self, rebase: Rebase) -> None:
        """Steps are counted again in this command's steps: the LR schedule's position (its length already is)
        and whatever the callbacks count in steps move to the same place in the data."""
        if self.scheduler is not None and not move_to_step(self.scheduler, self.state.step):
            inner = getattr(self.scheduler, "scheduler", self.scheduler)
            self.accelerator.print(
                f"warning: the LR scheduler {type(inner).__name__} cannot be moved to step {self.state.step} (its "
                f"rate is not a formula of the step): it goes on from the checkpoint's step {rebase.saved_step}"
            )
        self.callbacks.on_rebase(self, rebase)

    def forget_another_metrics_best(self) -> None:
        """A resume under another --best-metric: the best so far was another metric's value (a loss of 2.3 is no
        top-1 to beat), so the best model and early stopping's count start again from here, said in one line."""
        state, saved = self.state, self.state.best_metric_name
        if saved is None or saved == self.best_metric:
            return
        self.accelerator.print(
            f"warning: the checkpoint's best so far was by {saved}, this run's by {self.best_metric}: the best model "
            "and early stopping start again from here (model_best.safetensors is replaced at the next evaluation)"
        )
        state.best_metric = state.best_step = state.early_stopping_best = None
        state.evaluations_without_improvement = 0

    # --- the loop's steps ---
    @contextmanager
    def epoch_batches(self, epoch: int) -> Iterator[Iterator[Any]]:
        """This epoch's batches on this rank (after the ones a resume skips), each timed."""
        loader = self.train_loader
        loader.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        if loader.generator is not None:  # worker seeds (augmentations) that depend only on (seed, epoch)
            loader.generator.manual_seed(self.config.seed * 100_003 + epoch)
        skip = self.state.batches_in_epoch if epoch == self.state.epoch else 0
        self.state.epoch, self.state.batches_in_epoch = epoch, skip
        with loaders.batches(self.accelerator.skip_first_batches(loader, skip) if skip else loader) as batches:
            self.step.restart_clock()
            yield batches

    def train_step(self, batch: Any) -> bool:
        """One micro-batch; True when it ended an optimizer step."""
        ended = self.step(batch)
        self.state.batches_in_epoch += 1
        self.watchdog.beat(f"batch {self.state.batches_in_epoch} of epoch {self.state.epoch + 1}")
        return ended

    def after_optimizer_step(self) -> None:
        """The agreement on stopping, then what is due at this step: callbacks, log, evaluate, checkpoint."""
        if self.scheduler is not None:
            self.scheduler.step()
        state, config = self.state, self.config
        state.step += 1
        eval_due = self.eval_loader is not None and every(state.step, config.eval_steps)
        checkpoint_due = self.checkpoints.due_at_step(state.step)
        # before the stop agreement: what the callbacks update per step (the EMA) belongs to the step, and a
        # stop saves the step whole
        self.callbacks.on_step_end(self)
        verdict = self.agreement.step_done(state.step, self.signals.received, wait=eval_due or checkpoint_due)
        if verdict:
            raise StopTraining(verdict)
        if every(state.step, config.log_steps) or state.step == self.total_steps:
            self.log_window()
        if eval_due:
            self.evaluate_now()
        if checkpoint_due:
            self.save()
        self.step.restart_clock()

    def end_of_epoch(self, epoch: int) -> None:
        verdict = self.agreement.flush()
        if verdict:
            raise StopTraining(verdict)
        self.state.epoch, self.state.batches_in_epoch = epoch + 1, 0
        # evaluated before the epoch's checkpoint: it carries this evaluation and the best metric with it
        due = (epoch + 1) == self.config.epochs or (epoch + 1) % self.config.eval_every_epochs == 0
        if self.eval_loader is not None and self.state.step != self.state.last_eval_step and due:
            self.evaluate_now()
        if self.checkpoints.due_at_epoch_end():
            self.save()

    def log_window(self) -> None:
        """The log window's loss and throughput to the callbacks (the progress bar, the trackers); epochs count
        from 1, as in history.json."""
        logs = self.step.logs(self.scheduler)
        self.state.last_loss = logs["train_loss"]
        self.callbacks.on_log(self, {**logs, "epoch": self.state.epoch + 1})

    # --- evaluation and the best model ---
    def stop_check(self) -> None:
        """Before each evaluation batch, on every rank: stop when any rank received a preemption signal."""
        self.watchdog.beat(f"an evaluation batch at step {self.state.step}")
        verdict = self.agreement.preempted(self.state.step, self.signals.received)
        if verdict:
            raise StopTraining(verdict)

    def run_evaluation(self, loader: Any, prefix: str) -> dict[str, Any]:
        task = self.task
        assert task.eval_fn is not None, "an eval or test loader needs an eval_fn"
        return evaluate(self.accelerator, self.model, loader, task.eval_fn, task.metrics_fn, prefix, self.stop_check)

    def evaluate_now(self) -> None:
        """Evaluate at this step; a stop in the middle leaves `eval_pending`, so the resumed run evaluates first."""
        state, phase = self.state, self.signals.phase
        state.eval_pending = True
        self.signals.enter(Phase.EVAL if phase is Phase.TRAIN else phase)
        metrics = self.run_evaluation(self.eval_loader, "eval")
        if self.ema is not None:  # the averaged weights on the same data, beside the raw ones
            metrics.update(self.ema.evaluate(self))
        self.signals.enter(phase)
        state.eval_pending, state.last_eval_step, state.eval_metrics = False, state.step, metrics
        self.accelerator.print(f"step {state.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers(metrics).items()))
        samples = state.samples_trained
        epoch = samples / state.epoch_samples if state.epoch_samples else state.step / self.steps_per_epoch
        self.history.record(self.accelerator, state.step, samples, epoch, state.last_loss, metrics)
        self.callbacks.on_evaluate(self, metrics)
        if self.config.early_stopping_patience:
            self.count_towards_early_stopping(metrics)

    def count_towards_early_stopping(self, metrics: dict[str, Any]) -> None:
        """An evaluation that does not improve --best-metric by more than --early-stopping-min-delta counts; after
        --early-stopping-patience of them in a row training ends. Every rank has the same metrics (gathered), so
        every rank decides the same at the same step; the count is in the training state (checkpoints)."""
        state, name, delta = self.state, self.best_metric, self.config.early_stopping_min_delta
        value = metrics.get(name) if name else None
        if name and isinstance(value, int | float) and math.isfinite(value):
            if improves(name, value, state.early_stopping_best, delta):
                state.early_stopping_best, state.evaluations_without_improvement = float(value), 0
                return
        state.evaluations_without_improvement += 1
        if state.evaluations_without_improvement >= (self.config.early_stopping_patience or 0):
            state.stopped_early = True
            self.accelerator.print(
                f"early stopping at step {state.step}: {name} has not improved by more than {delta:g} for "
                f"{state.evaluations_without_improvement} evaluations (best {state.early_stopping_best})"
            )

    def final_evaluations(self) -> None:
        """The last evaluation (unless the last step was just evaluated) and the test set, before the commit."""
        self.signals.enter(Phase.FINAL)
        verdict = self.agreement.flush()
        if verdict:
            raise StopTraining(verdict)
        if self.eval_loader is not None and self.state.step != self.state.last_eval_step:
            self.evaluate_now()
        if self.test_loader is not None:
            self.test_metrics = self.run_evaluation(self.test_loader, "test")
            self.accelerator.print("test: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers(self.test_metrics).items()))

    @contextmanager
    def slow_on_main(self, what: str, happens: bool = True) -> Iterator[None]:
        """Work that may take long on the main process only (a tracker server, a file on a slow disk): every rank
        waits for it under the watchdog's generous bound, not in the next step's all-reduce under the short one.
        `happens`: whether there is such work at all (the same on every rank)."""
        with self.watchdog.activity(what):
            yield
            if happens and self.accelerator.num_processes > 1:
                self.accelerator.wait_for_everyone()

    # --- checkpoints and stops ---
    def save(self) -> Path:
        started = time.perf_counter()
        with self.watchdog.activity(f"the checkpoint of step {self.state.step}", kind="checkpoint"):
            path = self.checkpoints.save(self.state, self.identity)
        self.signals.resume_hint = resume_hint(path)
        self.grace.check(time.perf_counter() - started)
        self.callbacks.on_checkpoint(self, path)
        return path

    def stop(self, verdict: Verdict) -> None:
        """Every rank: a loss that is not finite ends the run (no checkpoint of a broken model); a preemption
        checkpoints the step reached (unless it was just saved), leaves the marker and raises Preempted."""
        state = self.state
        if verdict.nonfinite:
            best = self.folder.staging / "model_best.safetensors"
            kept = (
                f" The best model so far ({self.best_metric} {state.best_metric:.4g} at step {state.best_step}) "
                f"is {best}."
                if state.best_metric is not None and best.is_file()
                else ""
            )
            raise UserError(nonfinite_message(verdict.step, state.last_loss) + kept)
        started, phase = time.perf_counter(), self.signals.phase
        path = self.folder.checkpoints / f"step_{state.step}"
        if not self.checkpoints.holds(state, self.identity):
            path = self.save()
        facts = StopFacts(phase, verdict.signal, state.step, str(path), round(time.perf_counter() - started, 2))
        if self.accelerator.is_main_process:
            facts.write(self.folder.path)
        self.accelerator.wait_for_everyone()  # no process exits (and makes a launcher kill the rest) before the marker
        if self.signals.received is None:  # the signal reached a peer: it may still be on its way to this process
            time.sleep(1.0)
        raise Preempted(facts, by_peer=self.signals.received is None)

    def crashed(self, error: Exception) -> None:
        """A crash (not a user error, not a lost peer) that repeats from the same start (the same checkpoint, or
        none) at the same step is deterministic: a UserError, so that the launcher does not restart it again."""
        if isinstance(error, UserError) or lost_peers(error):
            return
        try:
            earlier = self.folder.repeated_failure(
                self.accelerator.process_index, self.resumed_from, self.state.step, error
            )
        except OSError:  # the output dir cannot take the note: the crash's own error is what matters
            return
        if earlier is not None:
            start = f"resuming from {self.resumed_from}" if self.resumed_from else "starting from the beginning"
            raise UserError(
                f"the run failed at step {self.state.step} with the same error the last two times, each after "
                f"{start} ({earlier}; the traceback is in the earlier attempt's log): a restart would fail the same "
                "way, so it stops here. Fix the cause, then continue with --resume-from-checkpoint latest",
                every_process=True,
            ) from error

    def exported_model(self) -> torch.nn.Module:
        """The model whose weights users read: without DDP's `module.` and without `_orig_mod.` where the accelerate
        config's dynamo_config wrapped it in torch.compile (--compile compiles in place: no wrapper); under
        FSDP/DeepSpeed the prepared model, from which the full weights are gathered."""
        if self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            return self.model
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    # --- the end: every final artifact committed at once ---
    def final_metrics(self) -> dict[str, Any]:
        """metrics.json: the last evaluation and test, the loss, the throughput, the topology, the best metric."""
        state, best = self.state, self.best_metric
        return {
            **state.eval_metrics,
            **self.test_metrics,
            "train_loss": state.last_loss,
            "steps": state.step,
            # how far training got, in a unit that does not change with the world size, batch size or accumulation
            "progress": {
                "epoch": state.epoch,
                "samples_in_epoch": state.samples_in_epoch,
                "samples": state.samples_trained,
            },
            "skipped_optimizer_steps": self.agreement.skipped_steps,
            "end_reason": (
                f"early stopping: {self.best_metric} did not improve for {state.evaluations_without_improvement} "
                "evaluations"
                if state.stopped_early
                else "completed"
            ),
            **self.step.meter.summary(),
            "wall_time_s": time.perf_counter() - self.wall_start,
            **(
                {"time_budget": {**self.budget.state_dict(), "command_s": round(time.time() - self.started, 1)}}
                if self.budget
                else {}
            ),
            "final_lr": self.optimizer.param_groups[0]["lr"],  # where the schedule ended (a plateau's decays)
            **topology(self.accelerator, self.micro_batch, self.accumulation),
            **(
                {"auto_batch_size": f"{self.config.batch_size} asked, {self.micro_batch} fits"}
                if self.config.auto_batch_size
                else {}
            ),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            **({"best_" + best.removeprefix("eval_"): state.best_metric} if best else {}),
            **self.record.extra_metrics,
            "identity": self.identity.identity or None,
        }

    def commit(self) -> dict[str, Any]:
        """model.safetensors (unwrapped: no `module.` prefix), model_best.safetensors, the scripts' own artifacts,
        args.json, training_curves.png and metrics.json (last: a run is complete once it exists for its steps),
        written aside and moved into place together; trackers closed. Signals received now are noted, not acted on:
        the commit is short, and a run stopped in it would have to redo it."""
        self.signals.enter(Phase.COMMIT)
        self.watchdog.stop()  # it watches training and evaluation; the commit writes files once
        accelerator, folder = self.accelerator, self.folder
        metrics = self.final_metrics()
        accelerator.wait_for_everyone()
        final = folder.staging / "model"
        with writing(final, cleanup=final):
            accelerator.save_model(self.exported_model(), str(final))  # every rank: FSDP gathers the full weights
            accelerator.wait_for_everyone()  # every rank is done with the folder before it goes
            if accelerator.is_main_process:
                if self.ema is not None:
                    folder.stage_weights("model_ema.safetensors", self.ema.weights())
                if self.history.records:
                    plot_history(self.history.records, folder.staging / "training_curves.png", self.record.title)
                write_json(folder.staging / "args.json", self.config.hyperparameters())
                folder.commit(final, self.record.artifacts, metrics)
        self.callbacks.on_end(self, metrics)
        self.signals.enter(Phase.DONE)
        accelerator.print(summary_line(metrics, folder.path))
        if self.budget is not None:
            accelerator.print(budget_line(self.budget, time.time() - self.started, self.resumed_from is not None))
        return metrics


def fit(
    accelerator: Accelerator,
    config: TrainConfig,
    task: Task,
    record: RunRecord | None = None,
    *,
    signals: StopSignals | None = None,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Train `task`: checkpoint, resume, evaluate (its `eval_loader`, and `test_loader` once at the end), log; then
    commit model.safetensors, model_best.safetensors (by `task.best_metric`), the record's `artifacts`, args.json,
    training_curves.png and metrics.json together.

    Every process calls fit(). Returns the final metrics (the same on every rank). On SIGTERM/SIGUSR1/SIGHUP every rank
    checkpoints the step reached and fit raises `Preempted`; a loss that is not finite stops with a UserError.
    `signals`: the process's StopSignals (run_main's); without them fit uses the installed ones, or watches the
    signals itself while it runs (a notebook). `callbacks`: ddp_accel.callbacks.Callback hooks.
    """
    signals = signals or StopSignals.current
    run = TrainingRun(accelerator, config, task, record or RunRecord(), signals or StopSignals(), callbacks)
    if run.signals.output_dir is None:
        run.signals.set_output_dir(run.folder.path)
    with run.signals if signals is None else contextlib.nullcontext(), run:
        committed = run.start()
        if committed is not None:
            return committed
        state = run.state
        try:
            if state.eval_pending:  # stopped while evaluating this step: evaluate it first
                run.evaluate_now()
                run.watchdog.rearm()
            for epoch in range(state.epoch, run.config.epochs):  # (--time-budget may have chosen fewer)
                if state.step >= run.total_steps or state.stopped_early:
                    break
                with run.epoch_batches(epoch) as batches:
                    for batch in batches:
                        # --max-steps reached, or early stopping, mid-epoch: no end-of-epoch work
                        if state.step >= run.total_steps or state.stopped_early:
                            break
                        if run.train_step(batch):
                            run.after_optimizer_step()
                    else:  # the epoch ran to its end
                        run.end_of_epoch(epoch)
            run.final_evaluations()
        except StopTraining as stop:
            run.stop(stop.verdict)
        except Exception as error:
            run.crashed(error)
            raise
        return run.commit()


def nonfinite_message(step: int, last_loss: float | None) -> str:
    last = (
        f"the last logged loss was {last_loss:.4g}"
        if last_loss is not None and math.isfinite(last_loss)
        else "no loss was logged before"
    )
    return (
        f"the training loss is not finite (nan or inf) at step {step}; {last}. "
        "Lower --lr, set --max-grad-norm, or check the data for bad values."
    )


def budget_line(plan: BudgetPlan, command_s: float, resumed: bool) -> str:
    """The command's time against its --time-budget, a warning when over it."""
    took, budget = format_duration(command_s), format_duration(plan.budget_s)
    if resumed:
        return f"time budget: this command, a resume of a run planned for {budget}, took {took}"
    planned = f"planned {format_duration(plan.estimated_s)}, with {format_duration(plan.reserve_s)} in reserve"
    if command_s <= plan.budget_s:
        return f"time budget: the command took {took} of its --time-budget {budget} ({planned})"
    return (
        f"warning: the command took {took}, over its --time-budget {budget} ({planned}): this machine ran slower "
        "than in the batches timed at the start"
    )


def resume_hint(path: Path) -> str:
    return f"The newest checkpoint is {path}; to continue, run the same command with --resume-from-checkpoint latest."


def summary_line(metrics: dict[str, Any], output_dir: Path) -> str:
    """The last line of a run: what it reached and where its outputs are."""
    scores = ", ".join(
        f"{key} {value:.4g}"
        for key, value in numbers(metrics).items()
        if key.startswith(("eval_", "test_", "ema_")) and not key.endswith("_samples")
    )
    return (
        f"done: {metrics['steps']} steps in {metrics['wall_time_s']:.0f} s on {metrics['world_size']} process(es)"
        f"{'; ' + scores if scores else ''}; model.safetensors, metrics.json and training_curves.png in {output_dir}"
    )
