"""The one training loop every script uses: fit() and evaluate(), and the run they drive (TrainingRun)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import find_batch_size
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ddp_accel import loaders
from ddp_accel.checkpoint import complete_checkpoints, load_checkpoint, model_fingerprint, resolve_resume
from ddp_accel.checkpoint import save_checkpoint as write_checkpoint
from ddp_accel.config import TrainConfig
from ddp_accel.errors import UserError
from ddp_accel.files import write_json, writing
from ddp_accel.identity import compare_identity
from ddp_accel.locking import lock_output_dir
from ddp_accel.plots import plot_history
from ddp_accel.runtime import print_banner, topology
from ddp_accel.state import TrainState
from ddp_accel.stopping import PREEMPTED_MARKER, Preempted, StepAgreement, StopSignals, Verdict
from ddp_accel.tracking import TRACKING_STATE, TrackerLog
from ddp_accel.watchdog import ProgressWatchdog

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]  # (model, batch) -> mean loss of the batch
EvalFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]  # (model, batch) -> per-sample values
MetricsFn = Callable[[dict[str, torch.Tensor]], dict[str, Any]]  # all samples' values -> metrics
# (optimizer, total optimizer steps, optimizer steps per epoch) -> LR scheduler stepped once per optimizer step
SchedulerFn = Callable[[torch.optim.Optimizer, int, int], Any]

FINAL_STAGING = ".final"  # under checkpoints/: the final model and the best model, until the commit moves them


class StopTraining(Exception):
    """The ranks agreed to stop (a preemption signal, or a loss that is not finite)."""

    def __init__(self, verdict: Verdict):
        super().__init__(str(verdict))
        self.verdict = verdict


def mean_metrics(outputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {key: values.float().mean().item() for key, values in outputs.items()}


@torch.no_grad()
def evaluate(
    accelerator: Accelerator,
    model: torch.nn.Module,
    loader: Any,
    eval_fn: EvalFn,
    metrics_fn: MetricsFn | None = None,
    prefix: str = "eval",
    stop_check: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Metrics over every sample of `loader` exactly once, whatever the world size.

    `gather_for_metrics` drops the samples the sharded loader repeated to give every rank equal batches.
    `stop_check` runs on every rank before each batch (fit's: raises StopTraining when the ranks agree to stop).
    """
    was_training = model.training
    model.eval()
    outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
    with loaders.batches(loader) as batches:
        for batch in batches:
            if stop_check is not None:
                stop_check()
            for key, values in accelerator.gather_for_metrics(eval_fn(model, batch)).items():
                outputs[key].append(values.detach().cpu())
    model.train(was_training)
    merged = {key: torch.cat(values) for key, values in outputs.items()}
    metrics = (metrics_fn or mean_metrics)(merged)
    metrics["samples"] = len(next(iter(merged.values()))) if merged else 0
    return {f"{prefix}_{key}": value for key, value in metrics.items()}


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The plain numbers of a metrics dict (per-class dicts and strings left out)."""
    return {
        key: value for key, value in values.items() if isinstance(value, int | float) and not isinstance(value, bool)
    }


def scalars(values: dict[str, Any]) -> dict[str, Any]:
    """What trackers accept as hyper-parameters."""
    return {key: value for key, value in values.items() if isinstance(value, int | float | str | bool)}


class ThroughputMeter:
    """Global samples/s and the share of step time spent waiting for data: over the whole run, over each log
    window (what the run does now), and steady (after the first window: cuDNN autotuning, compilation and
    worker start-up left out)."""

    def __init__(self) -> None:
        self.samples, self.train_time, self.data_wait = 0, 0.0, 0.0
        self._window_start = (0, 0.0, 0.0)
        self._steady_start: tuple[int, float, float] | None = None

    def add(self, samples: int, step_time: float, data_wait: float) -> None:
        self.samples += samples
        self.train_time += step_time
        self.data_wait += data_wait

    def window(self) -> tuple[float, float]:
        """(samples/s, data-wait share) since the previous call."""
        samples, train_time, data_wait = self._window_start
        elapsed = max(self.train_time - train_time, 1e-9)
        self._window_start = (self.samples, self.train_time, self.data_wait)
        self._steady_start = self._steady_start or self._window_start
        return (self.samples - samples) / elapsed, (self.data_wait - data_wait) / elapsed

    def summary(self) -> dict[str, Any]:
        steady = self._steady_start
        after_first = steady is not None and self.samples > steady[0]
        return {
            "train_samples": self.samples,
            "train_samples_per_s": self.samples / max(self.train_time, 1e-9),
            "data_wait_share": self.data_wait / max(self.train_time, 1e-9),
            # after the first log window; null when the run had a single window
            "steady_samples_per_s": (self.samples - steady[0]) / (self.train_time - steady[1])
            if steady and after_first
            else None,
            "steady_data_wait_share": (self.data_wait - steady[2]) / (self.train_time - steady[1])
            if steady and after_first
            else None,
        }


class EvalHistory:
    """history.json: one record per evaluation. A resumed run keeps the records up to its step and goes on."""

    def __init__(self, path: Path, resumed_at: int | None):
        self.path, old = path, []
        if resumed_at is not None and path.is_file():
            try:
                old = [record for record in json.loads(path.read_text()) if record["step"] <= resumed_at]
            except (ValueError, KeyError, TypeError):  # damaged: the curves restart, training does not suffer
                print(f"warning: {path} is unreadable; the evaluation history starts again", file=sys.stderr)
        self.records: list[dict] = old

    def record(
        self, accelerator: Accelerator, step: int, epoch: float, train_loss: float | None, metrics: dict
    ) -> None:
        self.records.append({"step": step, "epoch": epoch, "train_loss": train_loss, **numbers(metrics)})
        if accelerator.is_main_process:
            write_json(self.path, self.records, indent=1)


class LossWindow:
    """The training loss summed on the device since the last log (no host sync per step)."""

    def __init__(self, device: torch.device):
        self.total, self.batches = torch.zeros((), device=device), 0

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss
        self.batches += 1

    def mean(self, accelerator: Accelerator) -> float:
        """The mean over the window and over all processes; starts a new window."""
        value: float = accelerator.reduce(self.total / self.batches, "mean").item()
        self.total.zero_()
        self.batches = 0
        return value


def seed_loader_generators(seed: int, *loaders_: Any) -> None:
    """Creating a DataLoader iterator draws a worker seed from the global RNG unless the loader has a generator
    of its own. On a mid-epoch resume that draw would land after the restored RNG state (at epoch start in the
    uninterrupted run), and dropout masks would differ after the resume."""
    for loader in loaders_:
        if loader is not None and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(seed)


def every(step: int, period: int | str | None) -> bool:
    """True every `period` optimizer steps (`period` None or 'epoch': never)."""
    return isinstance(period, int) and step % period == 0


class TrainingRun:
    """Everything one call of fit() works with: the prepared objects, the position of training (`state`, one
    TrainState), the meters, and the artifacts it commits at the end. fit() reads as the loop; the steps are here."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: TrainConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: Any,
        loss_fn: LossFn,
        signals: StopSignals,
        **options: Any,
    ):
        self.accelerator, self.config, self.loss_fn, self.signals = accelerator, config, loss_fn, signals
        self.options = options
        self.eval_fn: EvalFn | None = options["eval_fn"]
        self.output_dir = Path(config.output_dir)
        self.root = self.output_dir / "checkpoints"
        self.staging = self.root / FINAL_STAGING
        self.state = TrainState(
            global_batch=config.batch_size * accelerator.num_processes,
            world_size=accelerator.num_processes,
            model_fingerprint=model_fingerprint(model),
            identity=options["identity"] or {},
        )
        seed_loader_generators(config.seed, train_loader, options["eval_loader"], options["test_loader"])
        self.model, self.optimizer, self.train_loader = accelerator.prepare(model, optimizer, train_loader)
        self.eval_loader, self.test_loader = (
            accelerator.prepare(options[name]) if options[name] is not None else None
            for name in ("eval_loader", "test_loader")
        )
        self.accumulation = config.gradient_accumulation_steps
        self.steps_per_epoch = math.ceil(len(self.train_loader) / self.accumulation)
        self.total_steps = int(min(config.epochs * self.steps_per_epoch, config.max_steps or math.inf))
        make_scheduler: SchedulerFn | None = options["make_scheduler"]
        self.scheduler = (
            accelerator.prepare(make_scheduler(self.optimizer, self.total_steps, self.steps_per_epoch))
            if make_scheduler
            else None
        )
        self.meter, self.window = ThroughputMeter(), LossWindow(accelerator.device)
        self.agreement = StepAgreement(accelerator)
        self.test_metrics: dict[str, Any] = {}
        self.resumed_from: Path | None = None
        self.lock: int | None = None  # the main process's flock on the output dir, held until fit returns
        self.progress: tqdm | None = None
        self.tick = time.perf_counter()  # when the current step began waiting for its batch
        self.grace_warned = False
        self.interactive = sys.stderr.isatty()  # in a log file, a line every 30 s instead of a redraw per step
        self.wall_start = time.perf_counter()
        self.watchdog = ProgressWatchdog(
            self.output_dir,
            accelerator.process_index,
            config.hang_timeout_s,
            phase=lambda: self.signals.phase,
        )

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.watchdog.stop()
        if self.progress is not None:
            self.progress.close()  # an error line then starts on a line of its own
        if self.lock is not None:
            os.close(self.lock)  # releases the output dir to the next run
            self.lock = None

    # --- start: every check first, then the first writes ---
    def start(self) -> dict[str, Any] | None:
        """Resume (or not), check the output dir; returns the committed metrics when the run is already complete."""
        print_banner(
            self.accelerator,
            self.options["title"],
            batch_size=self.config.batch_size,
            accumulation=self.accumulation,
            steps_per_epoch=self.steps_per_epoch,
            total_steps=self.total_steps,
            **(self.options["banner"] or {}),
        )
        complete = self.committed_run()
        if complete is not None:
            return complete
        checkpoints = complete_checkpoints(self.root)
        self.config.check_output_dir(has_checkpoints=bool(checkpoints))
        self.resume()
        if self.accelerator.is_main_process:
            self.lock = lock_output_dir(self.output_dir)
            if self.config.overwrite_output_dir and self.resumed_from is None:
                self.clear_previous_run()
        self.history = EvalHistory(self.output_dir / "history.json", self.state.step if self.resumed_from else None)
        self.tracking = TrackerLog(
            self.accelerator,
            self.output_dir,
            scalars(self.config.hyperparameters()),
            resumed=self.resumed_from is not None,
        )
        if self.resumed_from and self.state.last_eval_step < 0 and self.history.records:
            # a checkpoint of an earlier version does not record its last evaluation: history.json does
            self.state.last_eval_step = self.state.step if self.history.records[-1]["step"] == self.state.step else -1
        self.progress = tqdm(
            total=self.total_steps,
            initial=self.state.step,
            disable=not self.accelerator.is_local_main_process,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=0.1 if self.interactive else 30,
        )
        marker = self.output_dir / PREEMPTED_MARKER
        if self.resumed_from is not None and marker.is_file():  # the save time of the last stop, if it said
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                self.warn_if_save_outlasts_grace(float(json.loads(marker.read_text()).get("save_s") or 0))
        self.signals.enter("train")
        self.watchdog.start()
        return None

    def committed_run(self) -> dict[str, Any] | None:
        """A run whose artifacts were committed for at least the steps this command asks for, under the same
        identity, is complete: `--resume-from-checkpoint` then changes nothing."""
        path = self.output_dir / "metrics.json"
        if self.config.resume_from_checkpoint != "latest" or not path.is_file():
            return None
        try:
            committed = json.loads(path.read_text())
        except ValueError:
            return None
        if not isinstance(committed, dict) or not (self.output_dir / "model.safetensors").is_file():
            return None
        if committed.get("identity") and self.state.identity:
            compare_identity(committed["identity"], self.state.identity, f"the run in {self.output_dir}")
        if not isinstance(committed.get("steps"), int) or committed["steps"] < self.total_steps:
            return None
        self.accelerator.print(
            f"the run in {self.output_dir} is complete ({committed['steps']} steps); nothing to do. A larger --epochs "
            "or --max-steps continues it from its newest checkpoint."
        )
        self.signals.enter("done")
        return dict(committed)

    def resume(self) -> None:
        """Load `--resume-from-checkpoint` (if any) into the prepared objects and `state`."""
        config, state, accelerator = self.config, self.state, self.accelerator
        path = resolve_resume(config.resume_from_checkpoint, self.root, accelerator)
        if path is None:
            return
        global_batch, world_size = state.global_batch, state.world_size
        for warning in load_checkpoint(accelerator, path, state):
            accelerator.print(f"warning: {warning}")
        # The global sample order of an epoch depends on neither the world size nor the batch size, so a restart
        # with another global batch skips by samples.
        saved_batch, seen = state.global_batch or global_batch, state.samples_in_epoch
        skip, leftover = divmod(seen, global_batch)
        if saved_batch == global_batch:
            skip, leftover = state.batches_in_epoch, 0
        # Steps count the optimizer steps of this command's global batch and accumulation: the position in the data
        # (epoch, batches) says how many of them are done, whatever the checkpoint's own step counted
        done = self.steps_per_epoch if skip >= len(self.train_loader) else skip // self.accumulation  # a last,
        saved_step, state.step = state.step, state.epoch * self.steps_per_epoch + done  # partial group is a step
        if accelerator.is_main_process and (saved_batch != global_batch or saved_step != state.step):
            changed = (
                f"the global batch changed from {saved_batch} to {global_batch} samples: resuming after "
                f"{skip * global_batch} of the {seen} samples this epoch had seen"
                + (f" ({leftover} of them are seen again)" if leftover else "")
                if saved_batch != global_batch
                else f"the gradient accumulation changed: {skip} batches into epoch {state.epoch + 1}"
            )
            print(
                f"warning: {changed}, at step {state.step} of this command's {self.total_steps} (step {saved_step} "
                "as the checkpoint counted); the LR schedule goes on from its saved position",
                file=sys.stderr,
                flush=True,
            )
        if state.step > self.total_steps:
            raise UserError(
                f"checkpoint {path} is at step {state.step}, past the {self.total_steps} steps this command asks for; "
                "raise --epochs or --max-steps, or give an earlier step_N folder to --resume-from-checkpoint"
            )
        state.batches_in_epoch, state.global_batch, state.world_size = skip, global_batch, world_size
        scale = f", fp16 loss scale {accelerator.scaler.get_scale():g}" if accelerator.scaler is not None else ""
        accelerator.print(
            f"resumed from {path}: step {state.step}, epoch {state.epoch}, skipping {skip} batches of the epoch{scale}"
        )
        self.resumed_from = path
        self.signals.resume_hint = self.resume_hint(path)

    def clear_previous_run(self) -> None:
        """--overwrite-output-dir, once every check passed: the old run's checkpoints must not be resumed later, its
        curves and tracker runs not continued; its final artifacts are replaced at this run's commit."""
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.output_dir / "tensorboard", ignore_errors=True)
        for name in ("history.json", PREEMPTED_MARKER, TRACKING_STATE):
            (self.output_dir / name).unlink(missing_ok=True)

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
            yield batches

    def train_step(self, batch: Any) -> bool:
        """One micro-batch: forward and backward; on an accumulation boundary also clip and step (inside
        `accumulate`, Accelerate skips the gradient all-reduce and the optimizer step between boundaries).
        True when it ended an optimizer step."""
        accelerator, started = self.accelerator, time.perf_counter()
        with accelerator.accumulate(self.model):
            loss = self.loss_fn(self.model, batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients and self.config.max_grad_norm:
                accelerator.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        self.window.add(loss)
        self.agreement.observe(loss)
        self.state.batches_in_epoch += 1
        done = time.perf_counter()
        self.meter.add(find_batch_size(batch) * accelerator.num_processes, done - self.tick, started - self.tick)
        self.tick = done
        self.watchdog.beat(f"batch {self.state.batches_in_epoch} of epoch {self.state.epoch + 1}")
        return accelerator.sync_gradients

    def start_timing(self) -> None:
        self.tick = time.perf_counter()

    def after_optimizer_step(self) -> None:
        """The agreement on stopping, then what is due at this step: log, evaluate, checkpoint."""
        if self.scheduler is not None:
            self.scheduler.step()
        state, config = self.state, self.config
        state.step += 1
        if self.progress is not None:
            self.progress.update(1)
        eval_due = self.eval_loader is not None and every(state.step, config.eval_steps)
        checkpoint_due = every(state.step, config.checkpointing_steps)
        verdict = self.agreement.step_done(state.step, self.signals.received, wait=eval_due or checkpoint_due)
        if verdict:
            raise StopTraining(verdict)
        if every(state.step, config.log_steps) or state.step == self.total_steps:
            self.log_window()
        if eval_due:
            self.evaluate_now()
        if checkpoint_due:
            self.save()
        self.tick = time.perf_counter()

    def end_of_epoch(self, epoch: int) -> None:
        verdict = self.agreement.flush()
        if verdict:
            raise StopTraining(verdict)
        self.state.epoch, self.state.batches_in_epoch = epoch + 1, 0
        if self.config.checkpointing_steps == "epoch":
            self.save()
        due = (epoch + 1) == self.config.epochs or (epoch + 1) % self.config.eval_every_epochs == 0
        if self.eval_loader is not None and self.state.step != self.state.last_eval_step and due:
            self.evaluate_now()

    def stop_check(self) -> None:
        """Before each evaluation batch, on every rank: stop when any rank received a preemption signal."""
        self.watchdog.beat(f"an evaluation batch at step {self.state.step}")
        verdict = self.agreement.preempted(self.state.step, self.signals.received)
        if verdict:
            raise StopTraining(verdict)

    def evaluate_now(self) -> None:
        """Evaluate at this step; a stop in the middle leaves `eval_pending`, so the resumed run evaluates first."""
        state, phase = self.state, self.signals.phase
        assert self.eval_fn is not None
        state.eval_pending = True
        self.signals.enter("eval" if phase == "train" else phase)
        metrics = evaluate(
            self.accelerator,
            self.model,
            self.eval_loader,
            self.eval_fn,
            self.options["metrics_fn"],
            stop_check=self.stop_check,
        )
        self.signals.enter(phase)
        state.eval_pending, state.last_eval_step, state.eval_metrics = False, state.step, metrics
        with self.slow_on_main("logging to the trackers", self.tracking.active):  # a slow tracker server is not a hang
            self.tracking.log(metrics, state.step)
        self.accelerator.print(f"step {state.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers(metrics).items()))
        self.history.record(self.accelerator, state.step, state.step / self.steps_per_epoch, state.last_loss, metrics)
        with self.slow_on_main("saving the best model"):
            self.keep_best(metrics)

    def keep_best(self, metrics: dict[str, Any]) -> None:
        """The best model so far (by fit's `best_metric`, higher is better), staged until the commit."""
        name, state = self.options["best_metric"], self.state
        if name is None or (state.best_metric is not None and metrics[name] <= state.best_metric):
            return
        state.best_metric, state.best_step = metrics[name], state.step
        weights = self.accelerator.get_state_dict(self.model)  # every rank: gathered under FSDP
        if self.accelerator.is_main_process:
            self.staging.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in weights.items()}, str(self.staging / "model_best.partial"))
            os.replace(self.staging / "model_best.partial", self.staging / "model_best.safetensors")

    def final_evaluations(self) -> None:
        """The last evaluation (unless the last step was just evaluated) and the test set, before the commit."""
        self.signals.enter("final")
        verdict = self.agreement.flush()
        if verdict:
            raise StopTraining(verdict)
        if self.eval_loader is not None and self.state.step != self.state.last_eval_step:
            self.evaluate_now()
        if self.test_loader is not None:
            assert self.eval_fn is not None
            self.test_metrics = evaluate(
                self.accelerator,
                self.model,
                self.test_loader,
                self.eval_fn,
                self.options["metrics_fn"],
                prefix="test",
                stop_check=self.stop_check,
            )
            self.accelerator.print("test: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers(self.test_metrics).items()))

    def log_window(self) -> None:
        """The loss averaged over all processes, the throughput of the last log window (global samples), and with
        fp16 the gradient scaler's state: its skipped steps are never silent."""
        state, accelerator = self.state, self.accelerator
        state.last_loss = loss = self.window.mean(accelerator)
        speed, wait = self.meter.window()
        # epochs counted from 1, as in history.json
        postfix = {
            "loss": f"{loss:.4f}",
            "samples_s": f"{speed:.0f}",
            "data_wait": f"{wait:.0%}",
            "epoch": state.epoch + 1,
        }
        logs = {"train_loss": loss, "samples_per_s": speed, "data_wait_share": wait, "epoch": state.epoch + 1}
        if self.scheduler is not None:
            logs["lr"] = self.scheduler.get_last_lr()[0]
        if accelerator.scaler is not None:
            skipped = self.agreement.skipped_steps
            logs.update(loss_scale=accelerator.scaler.get_scale(), skipped_optimizer_steps=skipped)
            postfix["skipped"] = skipped
        if self.progress is not None:
            self.progress.set_postfix(postfix, refresh=self.interactive)  # a log file: a line per 30 s
        with self.slow_on_main("logging to the trackers", self.tracking.active):
            self.tracking.log(logs, state.step)

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
        with self.watchdog.activity(f"the checkpoint of step {self.state.step}"):
            path = write_checkpoint(self.accelerator, self.root, self.state, limit=self.config.checkpoint_limit)
        self.signals.resume_hint = self.resume_hint(path)
        self.warn_if_save_outlasts_grace(time.perf_counter() - started)
        return path

    def warn_if_save_outlasts_grace(self, save_s: float) -> None:
        """A launcher passes a preemption signal on, then kills its processes after a grace of its own: a save that
        takes longer is lost. Said once, at the first save that would not fit (or at start, from the last stop)."""
        grace = shutdown_grace_s()
        if grace is None or save_s <= grace or self.grace_warned:
            return
        self.grace_warned = True
        if self.accelerator.is_main_process:
            print(
                f"warning: saving a checkpoint takes {save_s:.0f} s, more than the {grace:.0f} s the launcher waits "
                "after passing on a preemption signal before it kills the processes: a preempted run would lose it. "
                "Raise TORCH_ELASTIC_SHUTDOWN_TIMEOUT (slurm/train.sbatch: GRACE_S) above the save time",
                file=sys.stderr,
                flush=True,
            )

    @staticmethod
    def resume_hint(path: Path) -> str:
        return (
            f"The newest checkpoint is {path}; to continue, run the same command with --resume-from-checkpoint latest."
        )

    def stop(self, verdict: Verdict) -> None:
        """Every rank: a loss that is not finite ends the run (no checkpoint of a broken model); a preemption
        checkpoints the step reached (unless it was just saved), leaves the marker and raises Preempted."""
        state = self.state
        if verdict.nonfinite:
            last = (
                f"the last logged loss was {state.last_loss:.4g}"
                if state.last_loss is not None and math.isfinite(state.last_loss)
                else "no loss was logged before"
            )
            raise UserError(
                f"the training loss is not finite (nan or inf) at step {verdict.step}; {last}. "
                "Lower --lr, set --max-grad-norm, or check the data for bad values."
            )
        started, phase = time.perf_counter(), self.signals.phase
        path = self.root / f"step_{state.step}"
        saved = (path / "training_state.json").is_file() and json.loads(
            (path / "training_state.json").read_text()
        ) == json.loads(json.dumps(state.state_dict()))
        if not saved:
            path = self.save()
        saved_s = time.perf_counter() - started
        if self.accelerator.is_main_process:
            write_json(
                self.output_dir / PREEMPTED_MARKER,
                {
                    "phase": phase,
                    "step": state.step,
                    "signal": verdict.signal,
                    "checkpoint": str(path),
                    "save_s": round(saved_s, 2),
                    "time": time.time(),
                },
            )
        self.accelerator.wait_for_everyone()  # no process exits (and makes a launcher kill the rest) before the marker
        if self.signals.received is None:  # the signal reached a peer: it may still be on its way to this process
            time.sleep(1.0)
        raise Preempted(
            f"preempted by {verdict.signal} at step {state.step} ({phase}): checkpoint {path} saved in {saved_s:.2f} s;"
            " to continue, run the same command with --resume-from-checkpoint latest",
            by_peer=self.signals.received is None,
        )

    # --- the end: every final artifact committed at once ---
    def commit(self) -> dict[str, Any]:
        """model.safetensors (unwrapped: no `module.` prefix), model_best.safetensors, the scripts' own artifacts,
        args.json, training_curves.png and metrics.json (last: a run is complete once it exists for its steps),
        written aside and moved into place together; trackers closed. Signals received now are noted, not acted on:
        the commit is short, and a run stopped in it would have to redo it."""
        self.signals.enter("commit")
        self.watchdog.stop()  # it watches training and evaluation; the commit writes files once
        accelerator, state, output_dir = self.accelerator, self.state, self.output_dir
        if self.progress is not None:
            self.progress.close()
        metrics = {
            **state.eval_metrics,
            **self.test_metrics,
            "train_loss": state.last_loss,
            "steps": state.step,
            "skipped_optimizer_steps": self.agreement.skipped_steps,
            **self.meter.summary(),
            "wall_time_s": time.perf_counter() - self.wall_start,
            **topology(accelerator, self.config.batch_size, self.accumulation),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            **(
                {"best_" + best.removeprefix("eval_"): state.best_metric}
                if (best := self.options["best_metric"])
                else {}
            ),
            **(self.options["extra_metrics"] or {}),
            "identity": state.identity or None,
        }
        accelerator.wait_for_everyone()
        final = self.staging / "model"
        with writing(final, cleanup=final):
            accelerator.save_model(self.model, str(final))  # every rank: under FSDP the full weights are gathered
            accelerator.wait_for_everyone()  # every rank is done with the folder before it goes
            if accelerator.is_main_process:
                self.move_final_artifacts(final, metrics)
        self.tracking.log({f"final_{key}": value for key, value in numbers(metrics).items()}, state.step)
        self.tracking.finish([output_dir / "model.safetensors", output_dir / "training_curves.png"])
        self.signals.enter("done")
        accelerator.print(summary_line(metrics, output_dir))
        return metrics

    def move_final_artifacts(self, final: Path, metrics: dict[str, Any]) -> None:
        output_dir = self.output_dir
        if self.history.records:
            plot_history(self.history.records, self.staging / "training_curves.png", self.options["title"])
        write_json(self.staging / "args.json", self.config.hyperparameters())
        for name, source in (self.options["artifacts"] or {}).items():
            shutil.copyfile(source, self.staging / name)
        for file in list(final.iterdir()) + [path for path in self.staging.iterdir() if path.is_file()]:
            os.replace(file, output_dir / file.name)
        final.rmdir()
        self.staging.rmdir()
        if not any(self.root.iterdir()):  # a run without checkpoints leaves no empty folder
            self.root.rmdir()
        write_json(output_dir / "metrics.json", metrics)
        (output_dir / PREEMPTED_MARKER).unlink(missing_ok=True)  # this run reached its end


def fit(
    accelerator: Accelerator,
    config: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: Any,
    loss_fn: LossFn,
    *,
    eval_loader: Any = None,
    eval_fn: EvalFn | None = None,
    metrics_fn: MetricsFn | None = None,
    test_loader: Any = None,
    make_scheduler: SchedulerFn | None = None,
    best_metric: str | None = None,
    title: str = "ddp_accel",
    banner: dict[str, Any] | None = None,
    extra_metrics: dict[str, Any] | None = None,
    artifacts: dict[str, Path] | None = None,
    identity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train `model`: checkpoint, resume, evaluate (`eval_loader`, and `test_loader` once at the end), log; then
    commit model.safetensors, model_best.safetensors (by `best_metric`), `artifacts` (name -> file to copy),
    args.json, training_curves.png and metrics.json (`extra_metrics` added) together.

    Every process calls fit(). Returns the final metrics (the same on every rank). On SIGTERM/SIGUSR1 every rank
    checkpoints the step reached and fit raises `Preempted`; a loss that is not finite stops with a UserError.
    `config.signals`: the process's StopSignals (run_main's); without them fit watches the signals while it runs.
    `identity` (ddp_accel.identity.make_identity): what must match for a resume.
    """
    signals = config.signals
    run = TrainingRun(
        accelerator, config, model, optimizer, train_loader, loss_fn, signals or StopSignals(),
        eval_loader=eval_loader, eval_fn=eval_fn, metrics_fn=metrics_fn, test_loader=test_loader,
        make_scheduler=make_scheduler, best_metric=best_metric, title=title, banner=banner,
        extra_metrics=extra_metrics, artifacts=artifacts, identity=identity,
    )  # fmt: skip
    run.signals.set_output_dir(run.output_dir)
    with run.signals if signals is None else _already_installed(), run:
        committed = run.start()
        if committed is not None:
            return committed
        state = run.state
        try:
            if state.eval_pending:  # stopped while evaluating this step: evaluate it first
                run.evaluate_now()
                run.watchdog.rearm()
            for epoch in range(state.epoch, config.epochs):
                if state.step >= run.total_steps:
                    break
                with run.epoch_batches(epoch) as batches:
                    run.start_timing()
                    for batch in batches:
                        if state.step >= run.total_steps:  # --max-steps reached mid-epoch: no end-of-epoch work
                            break
                        if run.train_step(batch):
                            run.after_optimizer_step()
                    else:  # the epoch ran to its end
                        run.end_of_epoch(epoch)
            run.final_evaluations()
        except StopTraining as stop:
            run.stop(stop.verdict)
        return run.commit()


@contextmanager
def _already_installed() -> Iterator[None]:
    yield


def shutdown_grace_s() -> float | None:
    """How long the launcher above this process waits after passing on a signal before it kills: torch elastic's
    --shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default; None without such a launcher."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        with contextlib.suppress(ValueError):
            if os.environ.get(name):
                return float(os.environ[name])
    return 30.0


def summary_line(metrics: dict[str, Any], output_dir: Path) -> str:
    """The last line of a run: what it reached and where its outputs are."""
    scores = ", ".join(
        f"{key} {value:.4g}"
        for key, value in numbers(metrics).items()
        if key.startswith(("eval_", "test_")) and not key.endswith("_samples")
    )
    return (
        f"done: {metrics['steps']} steps in {metrics['wall_time_s']:.0f} s on {metrics['world_size']} process(es)"
        f"{'; ' + scores if scores else ''}; model.safetensors, metrics.json and training_curves.png in {output_dir}"
    )
