"""The one training loop every script uses: `fit`, and the run it drives (`TrainingRun`).

The run holds the prepared objects and drives its components through narrow interfaces: `Checkpoints` decides
when, where and what to save and loads under the run's identity; `StepAgreement` agrees on stops; `TrainStep` runs
a micro-batch; the callbacks (progress bar, trackers, the weights' average, the best model, early stopping, the
profiler, the plateau schedule, yours) see a `RunContext`, never the run itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from ddp_accel import allocator, engines, loaders, rescue, run_end, run_start
from ddp_accel.budget import BudgetGuard, BudgetPlan, command_started, epochs_text
from ddp_accel.callbacks import Callback, Callbacks
from ddp_accel.checkpoint import Checkpoints, every, model_fingerprint, optimizer_fingerprint
from ddp_accel.config import TrainConfig
from ddp_accel.context import RunContext
from ddp_accel.endings import lost_peers
from ddp_accel.errors import UserError
from ddp_accel.evaluation import evaluate
from ddp_accel.meters import EvalHistory, numbers
from ddp_accel.run_folder import RunFolder
from ddp_accel.run_setup import (
    build_scheduler,
    check_options_against_task,
    checkpoint_contents,
    plan_time_budget,
    prepare_task,
    progress_watchdog,
    standard_callbacks,
)
from ddp_accel.runtime import exported_model, open_run
from ddp_accel.state import RunIdentity, TrainState
from ddp_accel.stopping import Phase, Preempted, SaveGrace, StepAgreement, StopFacts, StopSignals, Verdict
from ddp_accel.task import RunRecord, Task
from ddp_accel.train_step import TrainStep


class StopTraining(Exception):
    """The ranks agreed to stop (a preemption signal, or a loss that is not finite)."""

    def __init__(self, verdict: Verdict):
        super().__init__(str(verdict))
        self.verdict = verdict


class TrainingRun:
    """One call of fit(): the prepared objects, where training is (`state`) and who the run is (`identity`), its
    folder, checkpoints and callbacks, and the steps of the loop. fit() reads as the loop; the steps are here."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: TrainConfig,
        task: Task,
        record: RunRecord,
        signals: StopSignals,
        folder: RunFolder,
        callbacks: Sequence[Callback] = (),
    ):
        self.accelerator, self.config, self.task, self.record, self.signals = accelerator, config, task, record, signals
        self.folder = folder
        self.identity = RunIdentity(
            model_fingerprint(task.model), record.identity, optimizer_fingerprint(task.optimizer)
        )
        self.prepared = prepared = prepare_task(accelerator, config, task)
        self.model, self.optimizer, self.train_loader = prepared.model, prepared.optimizer, prepared.train_loader
        self.eval_loader, self.test_loader = prepared.eval_loader, prepared.test_loader
        self.micro_batch, self.accumulation = prepared.micro_batch, prepared.accumulation
        self.steps_per_epoch = prepared.steps_per_epoch
        self.state = TrainState(
            global_batch=self.micro_batch * accelerator.num_processes,
            world_size=accelerator.num_processes,
            epoch_samples=prepared.epoch_samples,
        )
        self.best_metric = config.best_metric or task.best_metric  # --best-metric, else the script's
        check_options_against_task(accelerator, config, task, self.best_metric)
        self.checkpoints = Checkpoints.of_run(accelerator, config, self.folder.listing)
        self.started = command_started(time.time())  # --time-budget's clock
        self.budget: BudgetPlan | None = None
        self.budget_kept = False
        if config.time_budget:
            plan = plan_time_budget(accelerator, config, task, prepared, self.checkpoints, self.folder, self.started)
            self.budget, self.budget_kept = plan
            self.state.time_budget = self.budget.state_dict()
        self.epochs = self.budget.epochs if self.budget else config.epochs  # (the budget's plan: at most --epochs)
        self.total_steps = int(min(self.epochs * self.steps_per_epoch, config.max_steps or math.inf))
        self.assemble(list(callbacks))

    def assemble(self, callbacks: list[Callback]) -> None:
        """The parts that follow from the run's length: the scheduler, the callbacks (saved by the checkpoints),
        the step, the agreement, the watchdog, and what the callbacks see."""
        accelerator, config, task = self.accelerator, self.config, self.task
        self.scheduler, feed = build_scheduler(
            accelerator, config, task, self.optimizer, self.total_steps, self.steps_per_epoch, self.best_metric
        )
        chosen_by = f" ({epochs_text(self.epochs)}: --time-budget's plan)" if self.budget else ""
        guard = [BudgetGuard(self.budget, self.started)] if self.budget else []  # (a resume's too)
        features = standard_callbacks(
            config, self.best_metric, self.total_steps, chosen_by, [*feed, *guard, *callbacks]
        )
        self.ema, self.callbacks = features.ema, Callbacks(features.callbacks)
        self.checkpoints.contents = checkpoint_contents(task, self.prepared, self.scheduler, features.callbacks)
        covered = rescue.rescuable(accelerator, self.checkpoints.contents)  # a survivor saves every rank's step
        self.agreement = StepAgreement(accelerator, streams=covered)
        self.agreement.keep_buffers(self.checkpoints.contents.objects.models)
        self.checkpoints.choose_interval(config.mtbf, covered)
        self.step = TrainStep(
            accelerator, self.model, self.optimizer, task.loss_fn, config.max_grad_norm, self.agreement
        )
        self.history = EvalHistory(self.folder.path / "history.json")
        self.test_metrics: dict[str, Any] = {}
        self.resumed_from: Path | None = None
        self.wall_start = time.perf_counter()
        self.grace = SaveGrace(accelerator.is_main_process)
        self.watchdog = progress_watchdog(self.folder, accelerator.process_index, config, self.signals)
        self.checkpoints.activity = lambda what, kind: self.watchdog.activity(what, kind=kind)
        self.checkpoints.on_saved.append(self.after_save)
        self.hyperparameters = dataclasses.replace(config, epochs=self.epochs).hyperparameters()
        self.context = RunContext(
            accelerator,
            self.model,
            self.optimizer,
            self.state,
            self.folder,
            self.total_steps,
            self.hyperparameters,
            lambda: exported_model(accelerator, self.model),
            lambda prefix: self.run_evaluation(self.eval_loader, prefix),
            self.watchdog.activity,
        )

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.watchdog.stop()
        self.checkpoints.abandon_writes()  # a failed run's write in flight: not past the folder's release
        self.callbacks.call("on_close", self.context)
        self.folder.release()  # the output dir, to the next run

    # --- start: every check first, then the first writes ---
    def start(self) -> dict[str, Any] | None:
        """Resume (or not), check the output dir; returns the committed metrics when the run is already complete."""
        allocator.keep_freed_memory(self.accelerator.device.type)  # CPU steps reuse the previous step's memory
        run_start.print_run_banner(self)
        complete = run_start.committed_run(self)
        if complete is not None:
            return complete
        config = self.config
        if not self.folder.checked:  # fit called without make_accelerator, or `latest`: it needs the checkpoints
            has_checkpoints = bool(self.checkpoints.complete())
            self.folder.check(config.resume_from_checkpoint, config.overwrite_output_dir, has_checkpoints)
        run_start.resume(self)
        if self.accelerator.is_main_process:
            self.folder.lock()
            if config.overwrite_output_dir and self.resumed_from is None:
                self.folder.clear_previous_run()
        if self.resumed_from is not None:
            # history.json up to the place the checkpoint saved (before a resize rounded it down to this command's
            # batches), and the last stop's save time against the launcher's grace
            self.history.continue_at(self.state, self.state.samples_trained + self.checkpoints.leftover)
            self.grace.check(StopFacts.last_save_s(self.folder.path))
        self.signals.enter(Phase.TRAIN)
        self.callbacks.call("on_start", self.context)
        self.watchdog.start()
        return None

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
        with loaders.batches(skipping(self.accelerator, loader, skip, epoch) if skip else loader) as batches:
            self.step.restart_clock()
            yield batches

    def train_step(self, batch: Any) -> bool:
        """One micro-batch; True when it ended an optimizer step."""
        ended = self.step(batch)
        self.state.batches_in_epoch += 1
        self.watchdog.beat(f"batch {self.state.batches_in_epoch} of epoch {self.state.epoch + 1}")
        return ended

    def after_optimizer_step(self) -> None:
        """The step's callbacks, the agreement on stopping, then what is due at this step: log, evaluate,
        checkpoint."""
        if self.scheduler is not None:
            self.scheduler.step()
        state, config = self.state, self.config
        state.step += 1
        eval_due = self.eval_loader is not None and every(state.step, config.eval_steps)
        checkpoint_due = self.checkpoints.due_at_step(state.step)
        # before the stop agreement: what the callbacks update per step (the EMA) belongs to the step, and a
        # stop saves the step whole
        self.callbacks.call("on_step_end", self.context)
        verdict = self.agreement.step_done(state.step, self.signals.received, wait=eval_due or checkpoint_due)
        if verdict:
            raise StopTraining(verdict)
        if every(state.step, config.log_steps) or state.step == self.total_steps:
            self.log_window()
        if eval_due:
            self.evaluate_now()
        self.checkpoints.maybe_save(state, self.identity)
        self.step.restart_clock()

    def end_of_epoch(self, epoch: int) -> None:
        verdict = self.agreement.flush()
        if verdict:
            raise StopTraining(verdict)
        self.state.epoch, self.state.batches_in_epoch = epoch + 1, 0
        # evaluated before the epoch's checkpoint: it carries this evaluation and the best metric with it
        due = (epoch + 1) == self.epochs or (epoch + 1) % self.config.eval_every_epochs == 0
        if self.eval_loader is not None and self.state.step != self.state.last_eval_step and due:
            self.evaluate_now()
        self.callbacks.call("on_epoch_end", self.context)  # (before the epoch's checkpoint: it carries their state)
        self.checkpoints.maybe_save(self.state, self.identity, epoch_end=True)

    def log_window(self) -> None:
        """The log window's loss and throughput to the callbacks (the progress bar, the trackers); epochs count
        from 1, as in history.json."""
        logs = self.step.logs(self.scheduler)
        self.state.last_loss = logs["train_loss"]
        self.callbacks.call("on_log", self.context, {**logs, "epoch": self.state.epoch + 1})

    # --- evaluation ---
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
        metrics.update(self.callbacks.extra_evaluation(self.context))  # the averaged weights, on the same data
        self.signals.enter(phase)
        state.eval_pending, state.last_eval_step, state.eval_metrics = False, state.step, metrics
        self.accelerator.print(f"step {state.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers(metrics).items()))
        samples = state.samples_trained
        epoch = samples / state.epoch_samples if state.epoch_samples else state.step / self.steps_per_epoch
        self.history.record(self.accelerator, state.step, samples, epoch, state.last_loss, metrics)
        self.callbacks.call("on_evaluate", self.context, metrics)

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

    # --- checkpoints and stops ---
    def after_save(self, path: Path, seconds: float) -> None:
        self.signals.resume_hint = run_start.resume_hint(path)
        self.grace.check(seconds)
        self.callbacks.call("on_checkpoint", self.context, path)

    def stop(self, verdict: Verdict) -> None:
        """Every rank: a loss that is not finite ends the run (no checkpoint of a broken model); a preemption
        checkpoints the step reached (unless it was just saved), leaves the marker and raises Preempted."""
        self.checkpoints.finish_writes()  # the write in flight (--async-checkpoint) completes first
        if verdict.nonfinite:
            raise UserError(nonfinite_message(verdict.step, self.state, self.folder, self.best_metric))
        started, phase = time.perf_counter(), self.signals.phase
        path = self.checkpoints.save_reached(self.state, self.identity)
        facts = StopFacts(phase, verdict.signal, self.state.step, str(path), round(time.perf_counter() - started, 2))
        if self.accelerator.is_main_process:
            facts.write(self.folder.path)
        self.accelerator.wait_for_everyone()  # no process exits (and makes a launcher kill the rest) before the marker
        if self.signals.received is None:  # the signal reached a peer: it may still be on its way to this process
            time.sleep(1.0)
        raise Preempted(facts, by_peer=self.signals.received is None)


def skipping(accelerator: Accelerator, loader: Any, batches: int, epoch: int) -> Any:
    """`loader` from its batch `batches` on, in `epoch`'s order: the new loader's own epoch is set (Accelerate
    before 1.15 starts it at 0, and a mid-epoch resume then went on in epoch 0's shuffle)."""
    skipped = accelerator.skip_first_batches(loader, batches)
    if hasattr(skipped, "set_epoch"):
        skipped.set_epoch(epoch)
    return skipped


class Run:
    """One training run, built from its options and the process's stop signals: its output folder (checked once,
    before anything is built), its Accelerator (for the script's data and model) and its trackers. `fit(task)`
    trains it. Every process builds its Run and calls fit.

        run = Run(config, signals)                      # signals: run_main's, passed to main(signals)
        model = build_model().to(run.accelerator.device)
        run.fit(Task(model, optimizer, loader, loss_fn), RunRecord(title="my run"))

    `check_output_dir=False`: not training into --output-dir (an evaluation). `find_unused_parameters`: DDP's."""

    def __init__(
        self,
        config: TrainConfig,
        signals: StopSignals | None = None,
        *,
        check_output_dir: bool = True,
        find_unused_parameters: bool = False,
    ):
        self.config, self.signals = config, signals
        self.folder, self.accelerator = open_run(
            config, signals, check_output_dir, find_unused_parameters=find_unused_parameters
        )

    def fit(self, task: Task, record: RunRecord | None = None, callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
        """Train `task` (see `ddp_accel.fit`); returns the final metrics, the same on every rank."""
        return train(self.accelerator, self.config, task, record, self.signals, self.folder, callbacks)


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
    signals itself while it runs (a notebook). `callbacks`: ddp_accel.callbacks.Callback hooks. With an Accelerator
    of your own (or make_accelerator's) the output folder is checked here; `Run` checks it once, before the
    Accelerator is built.
    """
    return train(accelerator, config, task, record, signals, RunFolder(config.output_dir), callbacks)


def train(
    accelerator: Accelerator,
    config: TrainConfig,
    task: Task,
    record: RunRecord | None,
    signals: StopSignals | None,
    folder: RunFolder,
    callbacks: Sequence[Callback],
) -> dict[str, Any]:
    """The loop (`fit`'s and `Run.fit`'s), in the run's `folder`."""
    signals = signals or StopSignals.current
    run = TrainingRun(accelerator, config, task, record or RunRecord(), signals or StopSignals(), folder, callbacks)
    if run.signals.output_dir is None:
        run.signals.set_output_dir(run.folder.path)
    with run.signals if signals is None else contextlib.nullcontext(), run:
        committed = run.start()
        if committed is not None:
            engines.note_metrics(committed)
            return committed
        state = run.state
        try:
            if state.eval_pending:  # stopped while evaluating this step: evaluate it first
                run.evaluate_now()
                run.watchdog.rearm()
            for epoch in range(state.epoch, run.epochs):  # (--time-budget may have chosen fewer than --epochs)
                if state.step >= run.total_steps or state.ended:
                    break
                with run.epoch_batches(epoch) as batches:
                    for batch in batches:
                        # --max-steps reached, or early stopping, mid-epoch: no end-of-epoch work
                        if state.step >= run.total_steps or state.ended:
                            break
                        if run.train_step(batch):
                            run.after_optimizer_step()
                    else:  # the epoch ran to its end
                        run.end_of_epoch(epoch)
            run.checkpoints.finish_writes()  # --async-checkpoint: the last one is complete before the final work
            run.final_evaluations()
        except StopTraining as stop:
            run.stop(stop.verdict)
        except Exception as error:
            if lost_peers(error):  # a survivor's save of the step reached, or the line saying why not
                rescue.say(
                    rescue.save_what_survived(
                        run.accelerator,
                        run.checkpoints.root,
                        run.state,
                        run.identity,
                        run.checkpoints.contents,
                        run.agreement,
                        run.accumulation,
                    )
                )
            elif not isinstance(error, UserError):  # a crash that repeats from the same start at the same step is
                # deterministic: a UserError then, so that the launcher does not restart it again
                run.folder.refuse_a_repeated_crash(run.accelerator.process_index, run.resumed_from, state.step, error)
            raise
        return run_end.commit(run)


def nonfinite_message(step: int, state: TrainState, folder: RunFolder, best_metric: str | None) -> str:
    last_loss = state.last_loss
    last = (
        f"the last logged loss was {last_loss:.4g}"
        if last_loss is not None and math.isfinite(last_loss)
        else "no loss was logged before"
    )
    best = folder.staging / "model_best.safetensors"
    kept = (
        f" The best model so far ({best_metric} {state.best_metric:.4g} at step {state.best_step}) is {best}."
        if state.best_metric is not None and best.is_file()
        else ""
    )
    return (
        f"the training loss is not finite (nan or inf) at step {step}; {last}. "
        "Lower --lr, set --max-grad-norm, or check the data for bad values." + kept
    )
