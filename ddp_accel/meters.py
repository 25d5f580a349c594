"""What a run measures while it trains: the loss of each log window, the throughput, and the evaluation history
(history.json)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import find_batch_size

from ddp_accel import recovery
from ddp_accel.files import write_json
from ddp_accel.startup import process_started_at, startup_phases


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The plain numbers of a metrics dict (per-class dicts and strings left out)."""
    return {
        key: value for key, value in values.items() if isinstance(value, int | float) and not isinstance(value, bool)
    }


def scalars(values: dict[str, Any]) -> dict[str, Any]:
    """What trackers accept as hyper-parameters."""
    return {key: value for key, value in values.items() if isinstance(value, int | float | str | bool)}


def improves(metric: str, value: float, reference: float | None, min_delta: float = 0.0) -> bool:
    """Whether `value` of `metric` beats `reference` by more than `min_delta`: lower is better for a `*loss`, higher
    for the rest; anything beats no reference. The best model and early stopping judge alike."""
    if reference is None:
        return True
    return (reference - value if metric.endswith("loss") else value - reference) > min_delta


class ThroughputMeter:
    """Global samples/s and the share of step time spent waiting for data: over the whole run, over each log
    window (what the run does now), and steady (after the first window: cuDNN autotuning, compilation and
    worker start-up left out); and the start-up: from the process's start to the end of its first step."""

    def __init__(self) -> None:
        self.samples, self.train_time, self.data_wait = 0, 0.0, 0.0
        self.first_step_at: float | None = None
        self.first_batch_at: float | None = None
        self._window_start = (0, 0.0, 0.0)
        self._steady_start: tuple[int, float, float] | None = None

    def add(self, samples: int, step_time: float, data_wait: float) -> None:
        if self.first_step_at is None:  # its batch came after its wait for data, its step's work followed
            self.first_step_at = time.time()
            self.first_batch_at = self.first_step_at - (step_time - data_wait)
            recovery.say_the_first_step()
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
            # this process's (under a launcher: the rank's, not the launcher's); null without a step
            "startup_s": self.first_step_at - process_started_at() if self.first_step_at else None,
            "first_step_at": self.first_step_at,
            # seconds from this process's start to each moment of its start-up (startup.mark)
            "startup_phases": startup_phases(self.first_batch_at, self.first_step_at)
            if self.first_batch_at and self.first_step_at
            else None,
        }


class EvalHistory:
    """history.json: one record per evaluation, at its step, its place in the data (`samples` trained, which only
    grows across a resize while steps are counted again) and epoch. A resumed run keeps the records up to its place
    and goes on."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []

    def keep_until(self, samples: int, step: int) -> None:
        """A resumed run: the records up to its place (a damaged file restarts the curves, not the training).
        Records of an earlier version have no `samples`: their step decides."""
        try:
            self.records = [
                record
                for record in json.loads(self.path.read_text())
                if (record["samples"] <= samples if "samples" in record else record["step"] <= step)
            ]
        except FileNotFoundError:
            self.records = []
        except (OSError, ValueError, KeyError, TypeError):
            print(f"warning: {self.path} is unreadable; the evaluation history starts again", file=sys.stderr)
            self.records = []

    def continue_at(self, state: Any, saved_samples: int) -> None:
        """A resumed run (`state`: its TrainState, `saved_samples`: the place the checkpoint saved, before a resize
        rounded it down to this command's batches): the records up to there; a checkpoint of an earlier version
        does not record its last evaluation, history.json does."""
        self.keep_until(saved_samples, state.step)
        if state.last_eval_step < 0 and self.records:
            last = self.records[-1]
            at_place = last.get("samples") == saved_samples if "samples" in last else last["step"] == state.step
            state.last_eval_step = state.step if at_place else -1

    def record(
        self, accelerator: Accelerator, step: int, samples: int, epoch: float, train_loss: float | None, metrics: dict
    ) -> None:
        self.records = [record for record in self.records if record.get("samples", -1) != samples]  # one per place
        self.records.append(
            {"step": step, "samples": samples, "epoch": epoch, "train_loss": train_loss, **numbers(metrics)}
        )
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


class LoopMeters:
    """The loop's figures of each micro-batch: the loss window, the throughput and the data wait (a batch's wait
    runs from the previous batch's end, or from `restart_clock` after an evaluation, a checkpoint or a worker
    start)."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.throughput, self.window = ThroughputMeter(), LossWindow(accelerator.device)
        self.tick = self.created = time.perf_counter()

    def restart_clock(self) -> None:
        self.tick = time.perf_counter()

    def add(self, batch: Any, loss: torch.Tensor, started: float) -> None:
        """A micro-batch that began computing at `started` (perf_counter) ended now with `loss`."""
        self.window.add(loss)
        done = time.perf_counter()
        samples = find_batch_size(batch) * self.accelerator.num_processes
        self.throughput.add(samples, done - self.tick, started - self.tick)
        self.tick = done

    def loop_metrics(self, skipped_steps: int) -> dict[str, Any]:
        """metrics.json's figures of the loop: the optimizer steps skipped, the throughput, the wall time."""
        return {
            "skipped_optimizer_steps": skipped_steps,
            **self.throughput.summary(),
            "wall_time_s": time.perf_counter() - self.created,
        }

    def logs(self, scheduler: Any, skipped_steps: int) -> dict[str, Any]:
        """The loss averaged over all processes, the throughput of the last log window (global samples), the
        learning rate, and with fp16 the gradient scaler's state: its skipped steps are never silent."""
        speed, wait = self.throughput.window()
        logs = {"train_loss": self.window.mean(self.accelerator), "samples_per_s": speed, "data_wait_share": wait}
        if scheduler is not None:
            logs["lr"] = scheduler.get_last_lr()[0]
        scaler = self.accelerator.scaler
        if scaler is not None:
            logs.update(loss_scale=scaler.get_scale(), skipped_optimizer_steps=skipped_steps)
        return logs
