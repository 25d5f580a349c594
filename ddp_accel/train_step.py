"""One micro-batch of training and what it measures: forward, backward and (on an accumulation boundary) the
clipped optimizer step; the loss window, the throughput and data wait, the non-finite check."""

from __future__ import annotations

import time
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import find_batch_size

from ddp_accel.agreement import StepAgreement
from ddp_accel.meters import LossWindow, ThroughputMeter
from ddp_accel.task import LossFn


class TrainStep:
    """Called once per micro-batch; True when the call ended an optimizer step. Inside `accumulate`, Accelerate
    skips the gradient all-reduce and the optimizer step between accumulation boundaries."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        max_grad_norm: float | None,
        agreement: StepAgreement,
    ):
        self.accelerator, self.model, self.optimizer, self.loss_fn = accelerator, model, optimizer, loss_fn
        self.max_grad_norm, self.agreement = max_grad_norm, agreement
        self.meter, self.window = ThroughputMeter(), LossWindow(accelerator.device)
        self.tick = self.created = time.perf_counter()  # when the current step began waiting for its batch

    def restart_clock(self) -> None:
        """The next batch's wait starts now (not during an evaluation, a checkpoint or a worker start)."""
        self.tick = time.perf_counter()

    def __call__(self, batch: Any) -> bool:
        accelerator, started = self.accelerator, time.perf_counter()
        with accelerator.accumulate(self.model):
            loss = self.loss_fn(self.model, batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients and self.max_grad_norm:
                accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        self.window.add(loss)
        self.agreement.observe(loss)
        done = time.perf_counter()
        self.meter.add(find_batch_size(batch) * accelerator.num_processes, done - self.tick, started - self.tick)
        self.tick = done
        return accelerator.sync_gradients

    def loop_metrics(self) -> dict[str, Any]:
        """metrics.json's figures of the loop: the optimizer steps skipped, the throughput, the wall time."""
        return {
            "skipped_optimizer_steps": self.agreement.skipped_steps,
            **self.meter.summary(),
            "wall_time_s": time.perf_counter() - self.created,
        }

    def logs(self, scheduler: Any) -> dict[str, Any]:
        """The loss averaged over all processes, the throughput of the last log window (global samples), the
        learning rate, and with fp16 the gradient scaler's state: its skipped steps are never silent."""
        speed, wait = self.meter.window()
        logs = {"train_loss": self.window.mean(self.accelerator), "samples_per_s": speed, "data_wait_share": wait}
        if scheduler is not None:
            logs["lr"] = scheduler.get_last_lr()[0]
        scaler = self.accelerator.scaler
        if scaler is not None:
            logs.update(loss_scale=scaler.get_scale(), skipped_optimizer_steps=self.agreement.skipped_steps)
        return logs
