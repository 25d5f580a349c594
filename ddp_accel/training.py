"""The one training loop every script uses: fit() and evaluate()."""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import find_batch_size
from tqdm.auto import tqdm

from ddp_accel.checkpoint import load_checkpoint, model_fingerprint, resolve_resume, save_checkpoint
from ddp_accel.errors import UserError
from ddp_accel.plots import plot_history
from ddp_accel.runtime import build_accelerator, print_banner, topology

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]  # (model, batch) -> mean loss of the batch
EvalFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]  # (model, batch) -> per-sample values
MetricsFn = Callable[[dict[str, torch.Tensor]], dict[str, float]]  # all samples' values -> metrics


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
    log_steps: int = 20
    with_tracking: bool = False
    mixed_precision: str | None = None
    timeout_s: int = 600

    @classmethod
    def from_args(cls, args) -> "TrainConfig":
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls) if hasattr(args, field.name)})

    def build_accelerator(self, **kwargs) -> Accelerator:
        output_dir = Path(self.output_dir)
        if output_dir.exists() and not output_dir.is_dir():
            raise UserError(f"--output-dir {output_dir} is a file; pass a folder (it is created if missing)")
        return build_accelerator(
            seed=self.seed, output_dir=self.output_dir, mixed_precision=self.mixed_precision,
            gradient_accumulation_steps=self.gradient_accumulation_steps, with_tracking=self.with_tracking,
            timeout_s=self.timeout_s, **kwargs,
        )


def mean_metrics(outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: values.float().mean().item() for key, values in outputs.items()}


@torch.no_grad()
def evaluate(accelerator: Accelerator, model, loader, eval_fn: EvalFn, metrics_fn: MetricsFn | None = None,
             prefix: str = "eval") -> dict[str, float]:
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


def _scalars(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if isinstance(value, (int, float, str, bool))}


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
    make_scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = None,
    eval_every_epochs: int = 1,
    hparams: dict[str, Any] | None = None,
    title: str = "ddp_accel",
    banner: dict[str, Any] | None = None,
    on_eval: Callable[[torch.nn.Module, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train `model`; checkpoint, resume, evaluate, log; write model.safetensors, metrics.json, args.json,
    history.json and training_curves.png.

    Every process calls fit(). Returns the final metrics (the same on every rank). `on_eval(model, metrics)`
    runs on every rank after each evaluation (e.g. to keep the best model).
    """
    output_dir = Path(config.output_dir)
    checkpoints = output_dir / "checkpoints"
    fingerprint = model_fingerprint(model)
    hparams = hparams if hparams is not None else asdict(config)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "args.json").write_text(json.dumps(hparams, indent=2, default=str))
    if config.with_tracking:
        accelerator.init_trackers("tensorboard", config=_scalars(hparams))

    for loader in (train_loader, eval_loader):
        # Creating a DataLoader iterator draws a worker seed from the global RNG unless the loader has a
        # generator of its own. That draw would land before the restored RNG state on a mid-epoch resume
        # (at epoch start in the uninterrupted run): dropout masks would then differ after resume.
        if loader is not None and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(config.seed)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    accumulation = config.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_loader) / accumulation)
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)
    scheduler = accelerator.prepare(make_scheduler(optimizer, total_steps)) if make_scheduler else None
    print_banner(accelerator, title, batch_size=config.batch_size, accumulation=accumulation,
                 steps_per_epoch=steps_per_epoch, total_steps=total_steps, **(banner or {}))

    step, start_epoch, skip_batches = 0, 0, 0
    resume_path = resolve_resume(config.resume_from_checkpoint, checkpoints)
    if resume_path is not None:
        state = load_checkpoint(accelerator, resume_path, fingerprint)
        step, start_epoch = state["step"], state["epoch"]
        # Batches this rank already consumed in the interrupted epoch. The global sample order of an
        # epoch does not depend on the world size, so a restart with another size skips by samples.
        global_batch = config.batch_size * accelerator.num_processes
        skip_batches = (state["batches_in_epoch"] if state["world_size"] == accelerator.num_processes
                        else state["samples_in_epoch"] // global_batch)
        accelerator.print(f"resumed from {resume_path}: step {step}, epoch {start_epoch}, "
                          f"skipping {skip_batches} batches of the epoch")

    def checkpoint(epoch: int, batches_in_epoch: int) -> None:
        save_checkpoint(accelerator, checkpoints, step, {
            "step": step, "epoch": epoch, "batches_in_epoch": batches_in_epoch,
            "samples_in_epoch": batches_in_epoch * config.batch_size * accelerator.num_processes,
            "world_size": accelerator.num_processes, "model_fingerprint": fingerprint,
        }, limit=config.checkpoint_limit)

    def run_eval() -> dict[str, float]:
        metrics = evaluate(accelerator, model, eval_loader, eval_fn, metrics_fn)
        accelerator.log(metrics, step=step)
        accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                                                        if isinstance(v, (int, float))))
        history.append({"step": step, "epoch": step / steps_per_epoch, "train_loss": last_loss,
                        **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
        if accelerator.is_main_process:
            (output_dir / "history.json").write_text(json.dumps(history, indent=1))
        if on_eval is not None:
            on_eval(model, metrics)
        return metrics

    interactive = sys.stderr.isatty()  # in a log file, a line every 30 s instead of a redraw per step
    progress = tqdm(total=total_steps, initial=step, disable=not accelerator.is_local_main_process,
                    desc="train", unit="step", dynamic_ncols=True, mininterval=0.1 if interactive else 30)
    eval_metrics: dict[str, float] = {}
    history_path = output_dir / "history.json"
    # evaluations so far; a resumed run continues the file
    history: list[dict] = json.loads(history_path.read_text()) if resume_path and history_path.is_file() else []
    history = [record for record in history if record["step"] <= step]
    last_eval_step, last_loss = -1, float("nan")
    window_loss, window_batches = torch.zeros((), device=accelerator.device), 0
    samples_seen, train_time, data_wait = 0, 0.0, 0.0
    window_start = (0, 0.0, 0.0)  # (samples_seen, train_time, data_wait) when the current log window began
    steady_start = None  # the same at the end of the first window: warm-up (cudnn autotune, compile) excluded
    wall_start = time.perf_counter()
    try:  # an error mid-epoch must not leave the bar's line unfinished before the error message
        model.train()
        for epoch in range(start_epoch, config.epochs):
            if step >= total_steps:
                break
            train_loader.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            batches = accelerator.skip_first_batches(train_loader, skip_batches) if skip_batches else train_loader
            batches_in_epoch, skip_batches = skip_batches, 0
            tick, ended_mid_epoch = time.perf_counter(), False
            for batch in batches:
                if step >= total_steps:  # --max-steps reached before the epoch's end
                    ended_mid_epoch = True
                    break
                data_wait += time.perf_counter() - tick
                with accelerator.accumulate(model):
                    loss = loss_fn(model, batch)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and config.max_grad_norm:
                        accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                window_loss += loss.detach()
                window_batches += 1
                batches_in_epoch += 1
                samples_seen += find_batch_size(batch) * accelerator.num_processes
                train_time += time.perf_counter() - tick
                if accelerator.sync_gradients:
                    if scheduler is not None:
                        scheduler.step()
                    step += 1
                    progress.update(1)
                    if step % config.log_steps == 0 or step == total_steps:
                        last_loss = accelerator.reduce(window_loss / window_batches, "mean").item()
                        window_loss.zero_()
                        window_batches = 0
                        # over this log window, global (all processes' samples): what the run does now
                        window_time = max(train_time - window_start[1], 1e-9)
                        speed = (samples_seen - window_start[0]) / window_time
                        wait = (data_wait - window_start[2]) / window_time
                        window_start = (samples_seen, train_time, data_wait)
                        steady_start = steady_start or window_start
                        progress.set_postfix(loss=f"{last_loss:.4f}", samples_s=f"{speed:.0f}", data_wait=f"{wait:.0%}",
                                             epoch=epoch, refresh=interactive)  # a log file: a line per 30 s
                        logs = {"train_loss": last_loss, "samples_per_s": speed, "data_wait_share": wait, "epoch": epoch}
                        if scheduler is not None:
                            logs["lr"] = scheduler.get_last_lr()[0]
                        accelerator.log(logs, step=step)
                    if eval_loader is not None and config.eval_steps and step % config.eval_steps == 0:
                        eval_metrics, last_eval_step = run_eval(), step
                    if isinstance(config.checkpointing_steps, int) and step % config.checkpointing_steps == 0:
                        checkpoint(epoch, batches_in_epoch)
                tick = time.perf_counter()
            if ended_mid_epoch:
                break
            if config.checkpointing_steps == "epoch":
                checkpoint(epoch + 1, 0)
            last_epoch = (epoch + 1) == config.epochs
            if eval_loader is not None and step != last_eval_step and (last_epoch or (epoch + 1) % eval_every_epochs == 0):
                eval_metrics, last_eval_step = run_eval(), step
    finally:
        progress.close()
    if eval_loader is not None and step != last_eval_step:
        eval_metrics = run_eval()

    wall_time = time.perf_counter() - wall_start
    metrics = {
        **eval_metrics,
        "train_loss": last_loss,
        "steps": step,
        "train_samples": samples_seen,
        "train_samples_per_s": samples_seen / max(train_time, 1e-9),
        "data_wait_share": data_wait / max(train_time, 1e-9),
        # after the first log window; null when the run had a single window
        "steady_samples_per_s": ((samples_seen - steady_start[0]) / (train_time - steady_start[1])
                                 if steady_start and samples_seen > steady_start[0] else None),
        "wall_time_s": wall_time,
        **topology(accelerator, config.batch_size, accumulation),
        "resumed_from": str(resume_path) if resume_path else None,
    }
    accelerator.wait_for_everyone()
    accelerator.save_model(model, str(output_dir))  # model.safetensors, unwrapped: no `module.` prefix
    if accelerator.is_main_process:
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        if history:
            plot_history(history, output_dir / "training_curves.png", title)
    for tracker in accelerator.trackers:
        tracker.finish()
    return metrics
