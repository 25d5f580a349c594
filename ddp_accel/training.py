"""The one training loop every script uses: fit() and evaluate(), and the small pieces fit() is made of."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import find_batch_size
from tqdm.auto import tqdm

from ddp_accel.checkpoint import (
    complete_checkpoints,
    load_checkpoint,
    model_fingerprint,
    resolve_resume,
    save_checkpoint,
)
from ddp_accel.errors import UserError
from ddp_accel.files import write_json
from ddp_accel.plots import plot_history
from ddp_accel.runtime import build_accelerator, print_banner, topology
from ddp_accel.stopping import PREEMPTED_MARKER, Preempted, PreemptionSignals, StepAgreement, Verdict
from ddp_accel.tracking import TRACKING_STATE, TrackerLog, make_trackers, tracker_names

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]  # (model, batch) -> mean loss of the batch
EvalFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]  # (model, batch) -> per-sample values
MetricsFn = Callable[[dict[str, torch.Tensor]], dict[str, float]]  # all samples' values -> metrics
# (optimizer, total optimizer steps, optimizer steps per epoch) -> LR scheduler stepped once per optimizer step
SchedulerFn = Callable[[torch.optim.Optimizer, int, int], Any]
OnEvalFn = Callable[[torch.nn.Module, dict[str, Any]], None]  # (model, eval metrics), on every rank


@dataclass
class TrainConfig:
    output_dir: str = "outputs/run"
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    lr: float = 1e-3
    seed: int = 0
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    checkpointing_steps: int | str | None = None
    checkpoint_limit: int | None = None
    resume_from_checkpoint: str | None = None
    eval_steps: int | None = None
    eval_every_epochs: int = 1
    log_steps: int = 20
    with_tracking: bool = False
    report_to: str = "none"
    mixed_precision: str | None = None
    timeout_s: int = 600
    overwrite_output_dir: bool = False
    hparams: dict[str, Any] | None = field(default=None, repr=False)  # what args.json records; default: this

    @classmethod
    def from_args(cls, args, **overrides) -> TrainConfig:
        """The shared options of a parsed command line; every argument is kept for args.json and trackers."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, "hparams": dict(vars(args)), **overrides})

    def make_accelerator(self, check_output_dir: bool = True, **kwargs) -> Accelerator:
        """The Accelerator, after checking --output-dir (pass check_output_dir=False when not training into it)."""
        if check_output_dir:
            self.check_output_dir()
        trackers = make_trackers(
            tracker_names(self.report_to, self.with_tracking),
            self.output_dir,
            resuming=self.resume_from_checkpoint is not None,
        )
        return build_accelerator(
            seed=self.seed,
            output_dir=self.output_dir,
            mixed_precision=self.mixed_precision,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            log_with=trackers or None,
            timeout_s=self.timeout_s,
            **kwargs,
        )

    def check_output_dir(self) -> None:
        """The Hugging Face convention: a new run does not silently replace a trained model or the checkpoints of
        an unfinished run. Runs that resume (restarts, requeues) are not affected."""
        output_dir = Path(self.output_dir)
        if output_dir.exists() and not output_dir.is_dir():
            raise UserError(f"--output-dir {output_dir} is a file; pass a folder (it is created if missing)")
        if self.resume_from_checkpoint is not None or not output_dir.is_dir():
            return
        held = (
            "a trained model (model.safetensors)"
            if (output_dir / "model.safetensors").exists()
            else "checkpoints of an unfinished run"
            if complete_checkpoints(output_dir / "checkpoints")
            else None
        )
        if held and not self.overwrite_output_dir:
            raise UserError(
                f"--output-dir {output_dir} already holds {held}; continue it with "
                "--resume-from-checkpoint latest, replace it with --overwrite-output-dir, or pick another "
                "--output-dir"
            )
        if held and int(os.environ.get("RANK", "0")) == 0:  # the old run's checkpoints must not be resumed later
            shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
            shutil.rmtree(output_dir / "tensorboard", ignore_errors=True)  # one run per directory
            for name in ("history.json", "metrics.json", PREEMPTED_MARKER, TRACKING_STATE):
                (output_dir / name).unlink(missing_ok=True)

    def hyperparameters(self) -> dict[str, Any]:
        if self.hparams is not None:
            return self.hparams
        return {key: value for key, value in asdict(self).items() if key != "hparams"}


def mean_metrics(outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: values.float().mean().item() for key, values in outputs.items()}


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model, loader, eval_fn: EvalFn, metrics_fn: MetricsFn | None = None, prefix: str = "eval"
) -> dict[str, float]:
    """Metrics over every sample of `loader` exactly once, whatever the world size.

    `gather_for_metrics` drops the samples the sharded loader repeated to give every rank equal batches.
    """
    was_training = model.training
    model.eval()
    outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
    for batch in loader:
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
        key: value for key, value in values.items() if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def scalars(values: dict[str, Any]) -> dict[str, Any]:
    """What trackers accept as hyper-parameters."""
    return {key: value for key, value in values.items() if isinstance(value, (int, float, str, bool))}


class ThroughputMeter:
    """Global samples/s and the share of step time spent waiting for data: over the whole run, over each log
    window (what the run does now), and steady (after the first window: cuDNN autotuning, compilation and
    worker start-up left out)."""

    def __init__(self):
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
        return {
            "train_samples": self.samples,
            "train_samples_per_s": self.samples / max(self.train_time, 1e-9),
            "data_wait_share": self.data_wait / max(self.train_time, 1e-9),
            # after the first log window; null when the run had a single window
            "steady_samples_per_s": (
                (self.samples - steady[0]) / (self.train_time - steady[1])
                if steady and self.samples > steady[0]
                else None
            ),
            "steady_data_wait_share": (
                (self.data_wait - steady[2]) / (self.train_time - steady[1])
                if steady and self.samples > steady[0]
                else None
            ),
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

    def record(self, accelerator: Accelerator, step: int, epoch: float, train_loss: float, metrics: dict) -> None:
        self.records.append({"step": step, "epoch": epoch, "train_loss": train_loss, **numbers(metrics)})
        if accelerator.is_main_process:
            write_json(self.path, self.records, indent=1)


@dataclass
class ResumePosition:
    checkpoint: Path | None = None
    step: int = 0
    epoch: int = 0
    skip_batches: int = 0  # batches of `epoch` this rank already consumed


def resume_position(
    accelerator: Accelerator, config: TrainConfig, fingerprint: str, steps_per_epoch: int
) -> ResumePosition:
    """Load `--resume-from-checkpoint` (if any) and say where training continues."""
    path = resolve_resume(config.resume_from_checkpoint, Path(config.output_dir) / "checkpoints", accelerator)
    if path is None:
        return ResumePosition()
    state = load_checkpoint(accelerator, path, fingerprint)
    # The global sample order of an epoch depends on neither the world size nor the batch size, so a restart
    # with another global batch skips by samples.
    global_batch = config.batch_size * accelerator.num_processes
    saved_batch = state.get(
        "global_batch", state["samples_in_epoch"] // max(1, state["batches_in_epoch"]) or global_batch
    )
    skip, leftover = divmod(state["samples_in_epoch"], global_batch)
    step = state["step"]
    if saved_batch == global_batch:
        skip, leftover = state["batches_in_epoch"], 0
    else:  # steps count batches of the new size from here on
        step = state["epoch"] * steps_per_epoch + skip // config.gradient_accumulation_steps
        if accelerator.is_main_process:
            print(
                f"warning: the global batch changed from {saved_batch} to {global_batch} samples: resuming after "
                f"{skip * global_batch} of the {state['samples_in_epoch']} samples this epoch had seen"
                + (f" ({leftover} of them are seen again)" if leftover else "")
                + f", at step {step} of the new size; the LR schedule goes on from its saved position",
                file=sys.stderr,
                flush=True,
            )
    scale = f", fp16 loss scale {accelerator.scaler.get_scale():g}" if accelerator.scaler is not None else ""
    accelerator.print(
        f"resumed from {path}: step {step}, epoch {state['epoch']}, skipping {skip} batches of the epoch{scale}"
    )
    return ResumePosition(path, step, state["epoch"], skip)


def checkpoint(
    accelerator: Accelerator, config: TrainConfig, step: int, epoch: int, batches_in_epoch: int, fingerprint: str
) -> None:
    save_checkpoint(
        accelerator,
        Path(config.output_dir) / "checkpoints",
        step,
        {
            "step": step,
            "epoch": epoch,
            "batches_in_epoch": batches_in_epoch,
            "samples_in_epoch": batches_in_epoch * config.batch_size * accelerator.num_processes,
            "global_batch": config.batch_size * accelerator.num_processes,
            "world_size": accelerator.num_processes,
            "model_fingerprint": fingerprint,
        },
        limit=config.checkpoint_limit,
    )


def seed_loader_generators(seed: int, *loaders) -> None:
    """Creating a DataLoader iterator draws a worker seed from the global RNG unless the loader has a generator
    of its own. On a mid-epoch resume that draw would land after the restored RNG state (at epoch start in the
    uninterrupted run), and dropout masks would differ after the resume."""
    for loader in loaders:
        if loader is not None and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(seed)


def write_final_artifacts(
    accelerator: Accelerator,
    model,
    output_dir: Path,
    metrics: dict,
    history: EvalHistory,
    tracking: TrackerLog,
    title: str,
) -> None:
    """model.safetensors (unwrapped: no `module.` prefix), metrics.json, training_curves.png; closes trackers."""
    accelerator.wait_for_everyone()
    partial = output_dir / ".model_partial"  # written aside: a crash leaves the previous model.safetensors whole
    accelerator.save_model(model, str(partial))  # every rank: under FSDP the full weights are gathered
    accelerator.wait_for_everyone()  # every rank is done with the folder before it goes
    if accelerator.is_main_process:
        for file in partial.iterdir():
            os.replace(file, output_dir / file.name)
        partial.rmdir()
        (output_dir / PREEMPTED_MARKER).unlink(missing_ok=True)  # this run reached its end
        write_json(output_dir / "metrics.json", metrics)
        if history.records:
            plot_history(history.records, output_dir / "training_curves.png", title)
    tracking.log({f"final_{key}": value for key, value in numbers(metrics).items()}, metrics["steps"])
    tracking.finish([output_dir / "model.safetensors", output_dir / "training_curves.png"])


def start_epoch(train_loader, seed: int, epoch: int) -> None:
    """A new shuffle each epoch, the same on every rank; and DataLoader worker seeds (random augmentations in
    workers) that depend only on (seed, epoch), so that a run resumed at an epoch boundary draws the same."""
    train_loader.set_epoch(epoch)
    if train_loader.generator is not None:
        train_loader.generator.manual_seed(seed * 100_003 + epoch)


def every(step: int, period) -> bool:
    """True every `period` optimizer steps (`period` None or 'epoch': never)."""
    return isinstance(period, int) and step % period == 0


def train_step(accelerator: Accelerator, model, optimizer, loss_fn: LossFn, batch, max_grad_norm: float | None):
    """One micro-batch: forward and backward; on an accumulation boundary also clip and step (inside
    `accumulate`, Accelerate skips the gradient all-reduce and the optimizer step between boundaries)."""
    with accelerator.accumulate(model):
        loss = loss_fn(model, batch)
        accelerator.backward(loss)
        if accelerator.sync_gradients and max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


class LossWindow:
    """The training loss summed on the device since the last log (no host sync per step)."""

    def __init__(self, device: torch.device):
        self.total, self.batches = torch.zeros((), device=device), 0

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss
        self.batches += 1

    def mean(self, accelerator: Accelerator) -> float:
        """The mean over the window and over all processes; starts a new window."""
        value = accelerator.reduce(self.total / self.batches, "mean").item()
        self.total.zero_()
        self.batches = 0
        return value


def stop_early(
    accelerator: Accelerator,
    config: TrainConfig,
    verdict: Verdict,
    step: int,
    epoch: int,
    batches_in_epoch: int,
    fingerprint: str,
    last_loss: float,
) -> None:
    """Every rank: a loss that is not finite ends the run (no checkpoint of a broken model); a preemption
    checkpoints the step reached (unless it was just saved), leaves the marker and raises Preempted."""
    if verdict.nonfinite:
        last = f"the last logged loss was {last_loss:.4g}" if math.isfinite(last_loss) else "no loss was logged before"
        raise UserError(
            f"the training loss is not finite (nan or inf) at step {verdict.step}; {last}. "
            "Lower --lr, set --max-grad-norm, or check the data for bad values."
        )
    started = time.perf_counter()
    path = Path(config.output_dir) / "checkpoints" / f"step_{step}"
    if not (path / "training_state.json").is_file():
        checkpoint(accelerator, config, step, epoch, batches_in_epoch, fingerprint)
    saved_s = time.perf_counter() - started
    why = verdict.signal
    if accelerator.is_main_process:
        write_json(
            Path(config.output_dir) / PREEMPTED_MARKER,
            {"step": step, "signal": why, "checkpoint": str(path), "save_s": round(saved_s, 2), "time": time.time()},
        )
    accelerator.wait_for_everyone()  # no process exits (and makes a launcher kill the rest) before the marker exists
    raise Preempted(
        f"preempted by {why} at step {step}: checkpoint {path} saved in {saved_s:.2f} s; "
        "to continue, run the same command with --resume-from-checkpoint latest"
    )


def fit(
    accelerator: Accelerator,
    config: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader,
    loss_fn: LossFn,
    *,
    eval_loader=None,
    eval_fn: EvalFn | None = None,
    metrics_fn: MetricsFn | None = None,
    make_scheduler: SchedulerFn | None = None,
    title: str = "ddp_accel",
    banner: dict[str, Any] | None = None,
    on_eval: OnEvalFn | None = None,
) -> dict[str, Any]:
    """Train `model`; checkpoint, resume, evaluate, log; write model.safetensors, metrics.json, args.json,
    history.json and training_curves.png. On SIGTERM/SIGUSR1 every rank checkpoints the step reached and fit
    raises `Preempted`; a loss that is not finite stops the run with a UserError.

    Every process calls fit(). Returns the final metrics (the same on every rank). `on_eval(model, metrics)`
    runs on every rank after each evaluation (e.g. to keep the best model).
    """
    output_dir = Path(config.output_dir)
    fingerprint = model_fingerprint(model)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_json(output_dir / "args.json", config.hyperparameters())
    seed_loader_generators(config.seed, train_loader, eval_loader)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    eval_loader = accelerator.prepare(eval_loader) if eval_loader is not None else None
    accumulation = config.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_loader) / accumulation)
    total_steps = min(config.epochs * steps_per_epoch, config.max_steps or math.inf)
    scheduler = accelerator.prepare(make_scheduler(optimizer, total_steps, steps_per_epoch)) if make_scheduler else None
    print_banner(
        accelerator,
        title,
        batch_size=config.batch_size,
        accumulation=accumulation,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        **(banner or {}),
    )
    start = resume_position(accelerator, config, fingerprint, steps_per_epoch)
    step = start.step
    history = EvalHistory(output_dir / "history.json", step if start.checkpoint else None)
    tracking = TrackerLog(accelerator, output_dir, scalars(config.hyperparameters()), resumed=bool(start.checkpoint))
    meter, window, agreement = ThroughputMeter(), LossWindow(accelerator.device), StepAgreement(accelerator)
    last_loss, eval_metrics, stop = float("nan"), {}, None
    last_eval_step = step if history.records and history.records[-1]["step"] == step else -1  # resumed after an eval

    def run_eval() -> dict[str, float]:
        metrics = evaluate(accelerator, model, eval_loader, eval_fn, metrics_fn)
        tracking.log(metrics, step)
        accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers(metrics).items()))
        history.record(accelerator, step, step / steps_per_epoch, last_loss, metrics)
        if on_eval is not None:
            on_eval(model, metrics)
        return metrics

    interactive = sys.stderr.isatty()  # in a log file, a line every 30 s instead of a redraw per step
    wall_start = time.perf_counter()
    with (
        tqdm(
            total=total_steps,
            initial=step,
            disable=not accelerator.is_local_main_process,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=0.1 if interactive else 30,
        ) as progress,
        PreemptionSignals() as signals,
    ):
        model.train()
        for epoch in range(start.epoch, config.epochs):
            if step >= total_steps:
                break
            start_epoch(train_loader, config.seed, epoch)
            skip = start.skip_batches if epoch == start.epoch else 0
            batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            batches_in_epoch, tick = skip, time.perf_counter()
            for batch in batches:
                if step >= total_steps:  # --max-steps reached mid-epoch: no end-of-epoch work
                    break
                data_wait = time.perf_counter() - tick
                loss = train_step(accelerator, model, optimizer, loss_fn, batch, config.max_grad_norm)
                window.add(loss)
                agreement.observe(loss)
                batches_in_epoch += 1
                meter.add(find_batch_size(batch) * accelerator.num_processes, time.perf_counter() - tick, data_wait)
                if accelerator.sync_gradients:
                    if scheduler is not None:
                        scheduler.step()
                    step += 1
                    progress.update(1)
                    eval_due = eval_loader is not None and every(step, config.eval_steps)
                    checkpoint_due = every(step, config.checkpointing_steps)
                    if stop := agreement.step_done(step, signals.received, wait=eval_due or checkpoint_due):
                        break
                    if every(step, config.log_steps) or step == total_steps:
                        last_loss = window.mean(accelerator)
                        log_window(
                            accelerator,
                            tracking,
                            progress,
                            meter,
                            last_loss,
                            step,
                            epoch,
                            scheduler,
                            agreement.skipped_steps,
                            interactive,
                        )
                    if eval_due:
                        eval_metrics, last_eval_step = run_eval(), step
                    if checkpoint_due:
                        checkpoint(accelerator, config, step, epoch, batches_in_epoch, fingerprint)
                tick = time.perf_counter()
            else:  # the epoch ran to its end
                if stop := agreement.flush():
                    break
                if config.checkpointing_steps == "epoch":
                    checkpoint(accelerator, config, step, epoch + 1, 0, fingerprint)
                due = (epoch + 1) == config.epochs or (epoch + 1) % config.eval_every_epochs == 0
                if eval_loader is not None and step != last_eval_step and due:
                    eval_metrics, last_eval_step = run_eval(), step
            if stop:  # `epoch` stays the one the stop happened in
                break
        if stop := stop or agreement.flush():
            stop_early(accelerator, config, stop, step, epoch, batches_in_epoch, fingerprint, last_loss)
    if eval_loader is not None and step != last_eval_step:
        eval_metrics = run_eval()

    metrics = {
        **eval_metrics,
        "train_loss": last_loss,
        "steps": step,
        "skipped_optimizer_steps": agreement.skipped_steps,
        **meter.summary(),
        "wall_time_s": time.perf_counter() - wall_start,
        **topology(accelerator, config.batch_size, accumulation),
        "resumed_from": str(start.checkpoint) if start.checkpoint else None,
    }
    write_final_artifacts(accelerator, model, output_dir, metrics, history, tracking, title)
    accelerator.print(summary_line(metrics, output_dir))
    return metrics


def summary_line(metrics: dict[str, Any], output_dir: Path) -> str:
    """The last line of a run: what it reached and where its outputs are."""
    scores = ", ".join(
        f"{key} {value:.4g}"
        for key, value in numbers(metrics).items()
        if key.startswith("eval_") and key != "eval_samples"
    )
    return (
        f"done: {metrics['steps']} steps in {metrics['wall_time_s']:.0f} s on {metrics['world_size']} process(es)"
        f"{'; ' + scores if scores else ''}; model.safetensors, metrics.json and training_curves.png in {output_dir}"
    )


def log_window(
    accelerator: Accelerator,
    tracking: TrackerLog,
    progress,
    meter: ThroughputMeter,
    loss: float,
    step: int,
    epoch: int,
    scheduler,
    skipped_steps: int,
    interactive: bool,
) -> None:
    """The loss averaged over all processes, the throughput of the last log window (global samples), and with
    fp16 the gradient scaler's state: its skipped steps are never silent."""
    speed, wait = meter.window()
    # epochs counted from 1, as in history.json
    postfix = {"loss": f"{loss:.4f}", "samples_s": f"{speed:.0f}", "data_wait": f"{wait:.0%}", "epoch": epoch + 1}
    logs = {"train_loss": loss, "samples_per_s": speed, "data_wait_share": wait, "epoch": epoch + 1}
    if scheduler is not None:
        logs["lr"] = scheduler.get_last_lr()[0]
    if accelerator.scaler is not None:
        logs.update(loss_scale=accelerator.scaler.get_scale(), skipped_optimizer_steps=skipped_steps)
        postfix["skipped"] = skipped_steps
    progress.set_postfix(postfix, refresh=interactive)  # a log file: a line per 30 s
    tracking.log(logs, step)
