"""The one way into a training run: `Run(config, signals).fit(task)` (`fit(accelerator, config, task)` is the same
with an Accelerator of your own). `Trainer` builds the run in one place, each component from its own section of
the options (`config.checkpointing`, `config.schedule`, ...); `train` is the loop, and `train_on` one micro-batch:
forward -> backward -> clip -> step -> schedule -> agreement -> log, evaluate, checkpoint, on one screen.

The callbacks (progress bar, trackers, the weights' average, the best model, early stopping, the profiler, the
plateau schedule, yours) see a `RunContext`, never the trainer itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch
from accelerate import Accelerator

from ddp_accel import (
    allocator,
    bad_samples,
    launch_environments,
    loaders,
    recovery,
    rescue,
    run_end,
    run_start,
    startup,
)
from ddp_accel.agreement import StepAgreement, Verdict
from ddp_accel.budget import command_started
from ddp_accel.callbacks import Callback, Callbacks
from ddp_accel.checkpoint import Checkpoints, every
from ddp_accel.checkpoint_format import held_step
from ddp_accel.config import TrainConfig
from ddp_accel.context import RunContext
from ddp_accel.endings import a_loader_worker_lost, lost_peers
from ddp_accel.errors import UserError
from ddp_accel.evaluation import Evaluations
from ddp_accel.exact_reduction import ExactReduction, refusal
from ddp_accel.identity import model_fingerprint, optimizer_fingerprint
from ddp_accel.meters import EvalHistory, LoopMeters
from ddp_accel.run_folder import RunFolder, check_weights_writable
from ddp_accel.run_setup import (
    build_scheduler,
    check_options_against_task,
    checkpoint_contents,
    prepare_task,
    progress_watchdog,
    run_length,
    standard_callbacks,
)
from ddp_accel.runtime import exported_model, open_run
from ddp_accel.state import RunIdentity, TrainState
from ddp_accel.stopping import Phase, SaveGrace, StopFacts, StopSignals
from ddp_accel.task import RunRecord, Task


class StopTraining(Exception):
    """The ranks agreed to stop (a preemption signal, or a loss that is not finite)."""

    def __init__(self, verdict: Verdict):
        super().__init__(str(verdict))
        self.verdict = verdict


def stop_on(verdict: Verdict | None) -> None:
    """The ranks' verdict at an agreement: stop when there is one."""
    if verdict:
        raise StopTraining(verdict)


class Trainer(contextlib.AbstractContextManager["Trainer"]):
    """One run, built in one place: the prepared objects, where training is (`state`) and who the run is
    (`identity`), and each component from its section of the options: the run's length (`config.length`), the
    schedule (`config.schedule`), the callbacks (`config.averaging`, `config.evaluation`, `config.tracking`), the
    agreement, the watchdog (`config.watchdog`), the checkpoints (`config.checkpointing`), the evaluations. Its
    phases are its methods (start, evaluate, stop, finish); the loop is `train`."""

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
        check_weights_writable(task.model)
        self.identity = RunIdentity(
            model_fingerprint(task.model), record.identity, optimizer_fingerprint(task.optimizer)
        )
        self.prepared = prepared = prepare_task(accelerator, config, task)
        self.model, self.optimizer = prepared.model, prepared.optimizer
        self.max_grad_norm = config.optimization.max_grad_norm
        self.exact = exact_reduction(accelerator, config, prepared.model)
        self.eval_loader = prepared.eval_loader
        self.state = TrainState(
            global_batch=prepared.micro_batch * accelerator.num_processes,
            world_size=accelerator.num_processes,
            epoch_samples=prepared.epoch_samples,
        )
        self.best_metric = config.best_metric or task.best_metric  # --best-metric, else the script's
        check_options_against_task(accelerator, config, task, self.best_metric)
        started = command_started(time.time())
        self.length = run_length(accelerator, config, task, prepared, self.folder, started, self.optimizer_step)
        if self.length.budget:
            self.state.time_budget = self.length.budget.state_dict()
        self.epochs, self.total_steps = self.length.epochs, self.length.total_steps
        self.assemble(list(callbacks))

    def assemble(self, callbacks: list[Callback]) -> None:
        """The parts that follow from the run's length: the scheduler, the callbacks (saved by the checkpoints),
        the step, the agreement, the watchdog, and what the callbacks see."""
        accelerator, config, task = self.accelerator, self.config, self.task
        self.scheduler, feed = build_scheduler(
            accelerator,
            config.schedule,
            task,
            self.optimizer,
            self.total_steps,
            self.prepared.steps_per_epoch,
            self.best_metric,
        )
        chosen_by, guard = self.length.guard()
        sections = config.averaging, config.evaluation, config.tracking
        given = [*feed, *guard, *callbacks]
        features = standard_callbacks(*sections, self.best_metric, self.total_steps, chosen_by, given)
        self.ema, self.callbacks = features.ema, Callbacks(features.callbacks)
        contents = checkpoint_contents(task, self.prepared, self.scheduler, features.callbacks)
        covered = rescue.rescuable(accelerator, contents)  # a survivor saves every rank's step
        self.agreement = StepAgreement(accelerator, streams=covered, generators=self.callbacks.random_generators())
        self.agreement.keep_buffers(contents.objects.models)
        self.meters = LoopMeters(accelerator)
        self.watchdog = progress_watchdog(self.folder, accelerator.process_index, config.watchdog, self.signals)
        activity = self.watchdog.activity
        self.checkpoints = Checkpoints.of_run(
            accelerator, config.checkpointing, self.folder.listing, contents, covered, activity, self.after_save
        )
        self.history = EvalHistory(self.folder.path / "history.json")
        self.evaluations = Evaluations(
            accelerator, self.model, task, self.history, self.prepared.steps_per_epoch, self.stop_check
        )
        self.test_metrics: dict[str, Any] = {}
        self.resumed_from: Path | None = None
        self.grace = SaveGrace(accelerator.is_main_process)
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
            lambda prefix: self.evaluations(self.eval_loader, prefix),
            self.watchdog.activity,
        )

    def __exit__(self, *exc: object) -> None:
        self.watchdog.stop()
        self.checkpoints.abandon_writes()  # a failed run's write in flight: not past the folder's release
        self.callbacks.call("on_close", self.context)
        self.folder.release()  # the output dir, to the next run

    # --- start: every check first, then the first writes ---
    def start(self) -> dict[str, Any] | None:
        """Resume (or not), check the output dir; returns the committed metrics when the run is already complete."""
        accelerator, config = self.accelerator, self.config
        allocator.keep_freed_memory(accelerator.device.type)  # CPU steps reuse the previous step's memory
        run_start.print_run_banner(
            accelerator, config, self.record, self.prepared, self.total_steps, self.checkpoints, self.length.banner()
        )
        complete = run_start.committed_run(
            accelerator, config, self.folder, self.identity, self.total_steps, self.prepared, self.state
        )
        if complete is not None:
            launch_environments.note_metrics(complete)
            self.signals.enter(Phase.DONE)
            return complete
        if not self.folder.checked:  # fit called without make_accelerator, or `latest`: it needs the checkpoints
            has_checkpoints = bool(self.checkpoints.complete())
            self.folder.check(config.resume_from_checkpoint, config.overwrite_output_dir, has_checkpoints)
        self.resume()
        if accelerator.is_main_process:  # the first writes
            self.folder.lock(clear=config.overwrite_output_dir and self.resumed_from is None)
        if self.resumed_from is not None:
            # history.json up to the place the checkpoint saved (before a resize rounded it down to this command's
            # batches), and the last stop's save time against the launcher's grace
            self.history.continue_at(self.state, self.state.samples_trained + self.checkpoints.leftover)
            self.grace.check(StopFacts.last_save_s(self.folder.path))
        self.signals.enter(Phase.TRAIN)
        self.callbacks.call("on_start", self.context)
        self.watchdog.start()
        return None

    def resume(self) -> None:
        """--resume-from-checkpoint (if any) into the prepared objects, the callbacks and `state`."""
        accelerator, state = self.accelerator, self.state
        path = run_start.load_checkpoint(
            accelerator, self.config, self.checkpoints, state, self.identity, self.prepared, self.total_steps
        )
        if path is not None:
            self.resumed_from = self.context.resumed_from = path
            self.signals.resume_hint = run_start.resume_hint(path)
            rebase = self.checkpoints.rebase
            if rebase is not None and rebase.recounted:  # what counts steps moves to the same place in the data
                run_start.move_the_schedule(accelerator, self.scheduler, state.step, rebase)
                self.callbacks.call("on_rebase", self.context, rebase)
        run_start.switch_best_metric(accelerator, state, self.best_metric)

    # --- the loop's parts (the loop itself: `train` and `train_on`, below) ---
    def optimizer_step(self, batch: Any) -> torch.Tensor:
        """forward -> backward -> clip -> step of one micro-batch; its loss. Inside `accumulate`, Accelerate skips
        the gradient all-reduce and the optimizer step between accumulation boundaries."""
        accelerator, model, optimizer, max_grad_norm = self.accelerator, self.model, self.optimizer, self.max_grad_norm
        with accelerator.accumulate(model):
            if self.exact:  # --exact-micro-batch: piece by piece, added in one order at the step's end
                loss = self.exact.compute(batch, self.task.loss_fn, self.state.step)
                if accelerator.sync_gradients:
                    self.exact.reduce()
            else:
                loss = self.task.loss_fn(model, batch)
                accelerator.backward(loss)
            if accelerator.sync_gradients and max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def end_of_epoch(self, epoch: int) -> None:
        stop_on(self.agreement.flush())
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
        logs = self.meters.logs(self.scheduler, self.agreement.skipped_steps)
        self.state.last_loss = logs["train_loss"]
        self.callbacks.call("on_log", self.context, {**logs, "epoch": self.state.epoch + 1})

    # --- evaluation ---
    def stop_check(self) -> None:
        """Before each evaluation batch, on every rank: stop when any rank received a preemption signal."""
        self.watchdog.beat(f"an evaluation batch at step {self.state.step}")
        stop_on(self.agreement.preempted(self.state.step, self.signals.received))

    def evaluate_now(self) -> None:
        """Evaluate at this step; a stop in the middle leaves `eval_pending`, so the resumed run evaluates first."""
        state, phase = self.state, self.signals.phase
        state.eval_pending = True
        self.signals.enter(Phase.EVAL if phase is Phase.TRAIN else phase)
        metrics = self.evaluations(self.eval_loader, "eval")
        metrics.update(self.callbacks.extra_evaluation(self.context))  # the averaged weights, on the same data
        self.signals.enter(phase)
        self.evaluations.record(state, metrics)
        self.callbacks.call("on_evaluate", self.context, metrics)

    def final_evaluations(self) -> None:
        """The last evaluation (unless the last step was just evaluated) and the test set, before the commit."""
        self.signals.enter(Phase.FINAL)
        stop_on(self.agreement.flush())
        if self.eval_loader is not None and self.state.step != self.state.last_eval_step:
            self.evaluate_now()
        if self.prepared.test_loader is not None:
            self.test_metrics = self.evaluations.test(self.prepared.test_loader)

    # --- checkpoints and stops ---
    def after_save(self, path: Path, seconds: float) -> None:
        self.signals.resume_hint = run_start.resume_hint(path)
        self.grace.check(seconds)
        self.callbacks.call("on_checkpoint", self.context, path)

    def stop(self, verdict: Verdict) -> None:
        """Every rank: a loss that is not finite ends the run (no checkpoint of a broken model); a preemption
        checkpoints the step reached and raises Preempted."""
        self.checkpoints.finish_writes()  # the write in flight (--async-checkpoint) completes first
        if verdict.nonfinite:
            raise UserError(nonfinite_message(verdict.step, self.state, self.folder, self.best_metric))
        stop_here(self, verdict)

    # --- the end ---
    def finish(self) -> dict[str, Any]:
        """Every rank: the final artifacts, then the last lines. Signals received now are noted, not acted on: the
        commit is short, and a run stopped in it would have to redo it. Returns metrics.json."""
        self.signals.enter(Phase.COMMIT)
        self.watchdog.stop()  # it watches training and evaluation; the commit writes files once
        trained = {
            **self.meters.loop_metrics(self.agreement.skipped_steps),
            **self.length.budget_metrics(time.time()),
            **self.prepared.trained_metrics(self.accelerator, self.config),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            **({"bad_samples": bad_samples.count(self.folder.path)} if self.config.skip_bad_samples else {}),
        }
        metrics = run_end.final_metrics(
            self.state, self.test_metrics, trained, self.best_metric, self.record, self.identity
        )
        final = run_end.FinalArtifacts(self.model, self.ema, self.history, self.record, self.hyperparameters)
        curves = run_end.commit(self.accelerator, self.folder, metrics, final)
        launch_environments.note_metrics(metrics)
        self.callbacks.call("on_end", self.context, metrics)
        self.signals.enter(Phase.DONE)
        self.accelerator.print(run_end.summary_line(metrics, self.folder.path, curves))
        if line := self.length.end_line(time.time(), self.resumed_from is not None):
            self.accelerator.print(line)
        if metrics.get("bad_samples"):
            self.accelerator.print(
                f"skipped {metrics['bad_samples']} bad sample(s), listed in {bad_samples.log_of(self.folder.path)}"
            )
        return metrics


def exact_reduction(accelerator: Accelerator, config: TrainConfig, model: torch.nn.Module) -> ExactReduction | None:
    """--exact-micro-batch's reduction, or the line that refuses it for this run."""
    micro_batch = config.communication.exact_micro_batch
    if not micro_batch:
        return None
    problem = refusal(accelerator, model, micro_batch)
    if problem:
        raise UserError(problem)
    return ExactReduction(accelerator, model, micro_batch, config.batch_size, config.seed)


@contextmanager
def epoch_batches(accelerator: Accelerator, loader: Any, seed: int, state: TrainState, epoch: int) -> Iterator[Any]:
    """This epoch's batches on this rank (after the ones a resume skips)."""
    set_loader_epoch(loader, epoch)
    if loader.generator is not None:  # worker seeds (augmentations) that depend only on (seed, epoch)
        loader.generator.manual_seed(seed * 100_003 + epoch)
    skip = state.batches_in_epoch if epoch == state.epoch else 0
    state.epoch, state.batches_in_epoch = epoch, skip
    with loaders.batches(skipping(accelerator, loader, skip, epoch) if skip else loader) as batches:
        yield batches


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """A new shuffle each epoch, the same on every rank, and the dataset's epoch (its augmentations' seeds): a
    loader Accelerate shards over processes passes the epoch to its sampler only, not to its dataset."""
    loader.set_epoch(epoch)
    if hasattr(getattr(loader, "dataset", None), "set_epoch"):
        loader.dataset.set_epoch(epoch)


def skipping(accelerator: Accelerator, loader: Any, batches: int, epoch: int) -> Any:
    """`loader` from its batch `batches` on, in `epoch`'s order: the new loader's own epoch is set (Accelerate
    before 1.15 starts it at 0, and a mid-epoch resume then went on in epoch 0's shuffle)."""
    skipped = accelerator.skip_first_batches(loader, batches)
    if hasattr(skipped, "set_epoch"):
        skipped.set_epoch(epoch)
    return skipped


class Run:
    """One training run, the one way into one: built from its options and the process's stop signals, with its
    output folder (checked once, before anything is built), its Accelerator (for the script's data and model) and
    its trackers. `fit(task)` trains it. Every process builds its Run and calls fit.

        run = Run(config, signals)                      # signals: run_main's, passed to main(signals)
        model = build_model().to(run.accelerator.device)
        run.fit(Task(model, optimizer, loader, loss_fn), RunRecord(title="my run"))

    `check_output_dir=False`: not training into --output-dir (an evaluation). `find_unused_parameters`: DDP's.
    `Run.around(accelerator, config)`: a run on an Accelerator of your own (its folder is checked by fit)."""

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

    def skipping_bad_samples(self, dataset: Any) -> Any:
        """The training dataset under --skip-bad-samples N: a sample that cannot be read is replaced by the next
        readable one, said and counted (ddp_accel.bad_samples); `dataset` itself without the option."""
        return bad_samples.skipping_bad_samples(dataset, self.config.output_dir, self.config.skip_bad_samples)

    @classmethod
    def around(cls, accelerator: Accelerator, config: TrainConfig, signals: StopSignals | None = None) -> Run:
        run = cls.__new__(cls)
        run.config, run.signals, run.accelerator = config, signals, accelerator
        run.folder = RunFolder(config.output_dir)
        return run

    def fit(self, task: Task, record: RunRecord | None = None, callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
        """Train `task`: checkpoint, resume, evaluate (its `eval_loader`, and `test_loader` once at the end), log;
        then commit model.safetensors, model_best.safetensors (by `task.best_metric`), the record's `artifacts`,
        args.json, training_curves.png and metrics.json together. Returns the final metrics (the same on every rank).

        On SIGTERM/SIGUSR1/SIGHUP every rank checkpoints the step reached and fit raises `Preempted`; a loss that
        is not finite stops with a UserError. Without the process's signals (run_main's), fit uses the installed
        ones, or watches the signals itself while it runs (a notebook). `callbacks`: ddp_accel.callbacks.Callback."""
        signals = self.signals or StopSignals.current
        startup.mark("data_and_model")  # what the script built before fit
        trainer = Trainer(
            self.accelerator, self.config, task, record or RunRecord(), signals or StopSignals(), self.folder, callbacks
        )
        startup.mark("prepared")
        if trainer.signals.output_dir is None:
            trainer.signals.set_output_dir(trainer.folder.path)
        with trainer.signals if signals is None else contextlib.nullcontext(), trainer:
            return train(trainer)


def fit(
    accelerator: Accelerator,
    config: TrainConfig,
    task: Task,
    record: RunRecord | None = None,
    *,
    signals: StopSignals | None = None,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """`Run.around(accelerator, config, signals).fit(task, record, callbacks)`: a run on an Accelerator of your own."""
    return Run.around(accelerator, config, signals).fit(task, record, callbacks)


def train(run: Trainer) -> dict[str, Any]:
    """The loop: every epoch's batches through `train_on`, the final evaluations, the commit; a stop saves the
    step reached. Returns metrics.json (a complete run's, committed before, when there is nothing to train)."""
    committed = run.start()
    if committed is not None:
        return committed
    startup.mark("started")  # resumed, banner said
    state = run.state
    try:
        if state.eval_pending:  # stopped while evaluating this step: evaluate it first
            run.evaluate_now()
            run.watchdog.rearm()
        for epoch in range(state.epoch, run.epochs):  # (--time-budget may have chosen fewer than --epochs)
            if state.step >= run.total_steps or state.ended:
                break
            with epoch_batches(run.accelerator, run.prepared.train_loader, run.config.seed, state, epoch) as batches:
                run.meters.restart_clock()  # each batch timed from here
                for batch in batches:
                    if state.step >= run.total_steps or state.ended:  # --max-steps or early stopping, mid-epoch
                        break
                    train_on(run, batch)
                else:  # the epoch ran to its end
                    run.end_of_epoch(epoch)
        run.checkpoints.finish_writes()  # --async-checkpoint: the last one is complete before the final work
        run.final_evaluations()
    except StopTraining as stop:
        run.stop(stop.verdict)
    except Exception as error:
        after_a_crash(run, error)
        raise
    return run.finish()


def train_on(run: Trainer, batch: Any) -> None:
    """One micro-batch: forward -> backward -> clip -> step (`optimizer_step`), then, where it ended an optimizer
    step, the schedule, the callbacks' step (the EMA), the ranks' agreement on stopping, and what is due at this
    step: log, evaluate, checkpoint."""
    state, config = run.state, run.config
    started = time.perf_counter()
    loss = run.optimizer_step(batch)
    run.meters.add(batch, loss, started)
    run.agreement.observe(loss)
    state.batches_in_epoch += 1
    run.watchdog.beat(f"batch {state.batches_in_epoch} of epoch {state.epoch + 1}")
    if not run.accelerator.sync_gradients:  # inside an accumulation group
        return
    if run.scheduler is not None:
        run.scheduler.step()
    state.step += 1
    eval_due = run.eval_loader is not None and every(state.step, config.eval_steps)
    checkpoint_due = run.checkpoints.due_at_step(state.step)
    # before the stop agreement: what the callbacks update per step (the EMA) belongs to the step, and a stop
    # saves the step whole
    run.callbacks.call("on_step_end", run.context)
    stop_on(run.agreement.step_done(state.step, run.signals.received, wait=eval_due or checkpoint_due))
    if every(state.step, config.log_steps) or state.step == run.total_steps:
        run.log_window()
    if eval_due:
        run.evaluate_now()
    run.checkpoints.maybe_save(state, run.identity)
    run.meters.restart_clock()


def after_a_crash(run: Trainer, error: Exception) -> None:
    """A peer lost: the survivors save the step reached (or a line says why not). Any other crash but a UserError
    is noted, and refused when it repeats from the same start at the same step: it is deterministic, and a
    UserError then keeps the launcher from restarting it again. Under in-process recovery a DataLoader worker
    killed (the OOM killer) costs no more: this process leaves the group (its state may be mid-step: torch raises
    from its SIGCHLD handler), its peers save the step they reached, and the next generation, the same processes,
    starts new workers there."""
    in_process = recovery.under_in_process_recovery()
    if in_process and a_loader_worker_lost(error):  # (raised anywhere, mid-step too: its peers save the step)
        rescue.say(
            f"process {run.accelerator.process_index}: {error}: the group goes on in a new one at the step reached"
        )
        raise recovery.Regroup(None) from error
    if lost_peers(error):
        root, contents = run.checkpoints.root, run.checkpoints.contents
        accumulation = run.prepared.accumulation
        saved = rescue.save_what_survived(
            run.accelerator, root, run.state, run.identity, contents, run.agreement, accumulation
        )
        rescue.say(saved)
        if in_process:  # the launcher forms a new group: this process goes on in it
            raise recovery.Regroup(regroup_facts(run)) from error
    elif not isinstance(error, UserError):
        rank, step = run.accelerator.process_index, run.state.step
        run.folder.refuse_a_repeated_crash(rank, run.resumed_from, step, error)


def stop_here(run: Trainer, verdict: Verdict) -> NoReturn:
    """A preemption: every process checkpoints the step reached and raises Preempted. A stop the in-process
    launcher asked for between steps (its replacements join at this step): every process keeps a copy of the step,
    which the replacements are given, and raises Regroup (where one could not: saved as a preemption's)."""
    if hand_back_agreed(run):
        root, contents, state, identity = run.checkpoints.root, run.checkpoints.contents, run.state, run.identity
        if rescue.keep_for_the_replacements(run.accelerator, root, state, identity, contents, run.agreement):
            deadline = time.monotonic() + 1.0  # the signal may still be on its way here: not into the next main
            while run.signals.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
            raise recovery.Regroup(regroup_facts(run))
    run_end.stop_here(run.accelerator, verdict, run.signals, run.checkpoints, run.state, run.identity, run.folder)


def hand_back_agreed(run: Trainer) -> bool:
    """Whether every process stops between steps for the in-process launcher's hand-back (each reads the launcher's
    word alone: they agree, so that all of them take the same path)."""
    if not recovery.under_in_process_recovery():
        return False
    asked = run.signals.phase is Phase.TRAIN and recovery.hand_back_asked()  # (an evaluation's stop: as it stands)
    accelerator = run.accelerator
    return accelerator.reduce(torch.tensor(float(asked), device=accelerator.device), "sum").item() == (
        accelerator.num_processes
    )


def regroup_facts(run: Trainer) -> recovery.Facts:
    """What this process tells the in-process launcher as it leaves its group (ddp_accel.recovery)."""
    step, exact = run.state.step, run.config.communication.exact_micro_batch or 0
    return recovery.Facts(step, run.state.global_batch, exact, held=held_step() == step)


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
