"""The per-step agreement of the ranks (`StepAgreement`): one small all-reduce (MAX) per optimizer step carries every
rank's flags (a loss that is not finite, a preemption signal received), and with a survivor's save possible (DDP on
the CPU) a digest of the rank's random streams and process 0's norm-layer statistics.

On a GPU the all-reduce is not waited for at once: its result is copied to pinned host memory and read at the next
step, so the host never waits for the step in flight (one step of lag); before a checkpoint or an evaluation the
current step's result is awaited. On a CPU the flags are plain Python values until the all-reduce (none at all with
one process): the check costs a few microseconds a step.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddp_accel.random_streams import RandomStreams


@dataclass
class Verdict:
    step: int  # the optimizer step the flags were raised at
    signal: str | None  # the preemption signal some rank received (the highest-numbered, if several)
    nonfinite: bool


NORM_LAYERS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.InstanceNorm1d,
    torch.nn.InstanceNorm2d,
    torch.nn.InstanceNorm3d,
)


def running_statistics(models: list[torch.nn.Module]) -> set[tuple[int, str]]:
    """(the model's index, the buffer's state-dict name) of the norm layers' running statistics each rank updates
    with its own batch (SyncBatchNorm's are every rank's already)."""
    found = set()
    for index, model in enumerate(models):
        for prefix, module in model.named_modules():
            if isinstance(module, NORM_LAYERS):
                for name, _ in module.named_buffers(recurse=False):
                    found.add((index, f"{prefix}.{name}" if prefix else name))
    return found


class StepAgreement:
    """Per optimizer step: every rank's (loss not finite, preempted) flags, combined with one MAX all-reduce.

    On a CPU the flags are plain Python values until the all-reduce (none at all with one process): the check costs
    a few microseconds a step. On a GPU they stay on the device and are read one step late (see the module doc).
    """

    def __init__(self, accelerator: Any, streams: bool = False, generators: dict[str, Any] | None = None):
        """`streams`: also agree, per step, whether every rank's random streams are the same (on a CPU): what a
        survivor of a lost peer needs to save every rank's place (`ddp_accel.rescue`); `generators`: the
        callbacks' own, compared with them."""
        self.accelerator, self.device = accelerator, accelerator.device
        self.lagged = self.device.type == "cuda"
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.skipped_steps = 0  # fp16: optimizer steps the gradient scaler skipped (inf/nan gradients)
        self.step_nonfinite: Any = torch.zeros((), device=self.device) if self.lagged else False  # any micro-batch
        self.streams = streams and self.distributed and not self.lagged
        self.generators = generators or {}
        flags_dtype = torch.float64 if self.streams else torch.float32  # (a 52-bit digest is exact in a float64)
        self._host = torch.zeros(4 if self.streams else 2, dtype=flags_dtype, pin_memory=self.lagged)
        self._pending: tuple[int, torch.cuda.Event] | None = None
        # (step, this rank's random streams after it, whether every rank's were the same): the newest agreed step's
        # and the one being agreed on (a collective that fails leaves it here)
        self.agreed_streams: tuple[int, RandomStreams, bool] | None = None
        self.submitted_streams: tuple[int, RandomStreams] | None = None
        # the models' buffers to copy at each agreement (`keep_buffers`): the next step's forward changes them (a
        # BatchNorm's statistics and count) before a collective can fail; (step, (model, name) -> copy), the newest.
        # The norm layers' statistics are each rank's own: process 0's (what a checkpoint keeps) travel in the
        # agreement's all-reduce, so every rank holds them
        self.buffers: list[tuple[tuple[int, str], torch.Tensor]] = []
        self.shared_buffers: list[tuple[tuple[int, str], torch.Tensor]] = []
        self.submitted_buffers: tuple[int, dict[tuple[int, str], torch.Tensor]] | None = None

    def step_done(self, step: int, signum: int | None, wait: bool = False) -> Verdict | None:
        """After optimizer step `step`: a verdict when the ranks agree to stop. `wait`: this step's verdict
        (before a checkpoint or an evaluation), else possibly the previous step's (GPU)."""
        self.skipped_steps += self.accelerator.optimizer_step_was_skipped
        # With fp16, inf/nan is the gradient scaler's business: it skips the step and halves the scale. Only a
        # scale driven below 1 (from 65536: a long run of overflows) means the run itself diverged.
        scaler = self.accelerator.scaler
        count_nonfinite = scaler is None or scaler.get_scale() < 1.0
        verdict = self.submit(step, signum or 0, count_nonfinite)
        return verdict or (self.flush() if wait else None)

    def observe(self, loss: torch.Tensor) -> None:
        """Each micro-batch's loss (on a GPU without a host sync)."""
        if self.lagged:
            self.step_nonfinite = torch.maximum(self.step_nonfinite, (~torch.isfinite(loss)).float())
        else:
            self.step_nonfinite = self.step_nonfinite or not math.isfinite(loss.item())

    def preempted(self, step: int, signum: int | None) -> Verdict | None:
        """Outside the training step (an evaluation batch): whether any rank received a signal, agreed now."""
        self.flush()
        flags = [0.0, float(signum or 0)] + [0.0] * (2 if self.streams else 0)  # (no streams compared here)
        if self.distributed:
            head = self._host[: len(flags)]
            head.copy_(torch.tensor(flags, dtype=self._host.dtype))
            dist.all_reduce(head, op=dist.ReduceOp.MAX)
            flags = head.tolist()
        return self._verdict(step, *flags[:2])

    def submit(self, step: int, signum: int, count_nonfinite: bool = True) -> Verdict | None:
        """Start the agreement on `step`. Returns the newest finished verdict that says stop, else None: on CPU
        this step's, on a GPU the previous step's (the host does not wait for the step in flight)."""
        if not self.lagged:
            flags = [float(self.step_nonfinite and count_nonfinite), float(signum)]
            self.step_nonfinite = False
            kept: dict[tuple[int, str], torch.Tensor] | None = None
            if self.streams:  # the streams' digest, and its negation: MAX of both says whether all are the same
                streams = RandomStreams.now(self.generators)
                self.submitted_streams = (step, streams)
                kept = {key: buffer.clone() for key, buffer in self.buffers} if self.buffers else None
                if kept is not None and self.accelerator.process_index == 0:  # process 0's are the checkpoint's
                    self.submitted_buffers = (step, kept)
                digest = float(streams.digest())
                flags += [digest, -digest]
            if self.distributed:
                self._host[: len(flags)].copy_(torch.tensor(flags, dtype=self._host.dtype))
                if len(self._host) > len(flags):
                    self._fill_shared_buffers(self._host[len(flags) :])
                dist.all_reduce(self._host, op=dist.ReduceOp.MAX)
                if kept is not None and self.accelerator.process_index != 0:
                    self.submitted_buffers = (step, {**kept, **self._shared_buffers(self._host[len(flags) :])})
                flags = self._host[: len(flags)].tolist()
            if self.streams and self.submitted_streams is not None:
                self.agreed_streams = (step, self.submitted_streams[1], flags[2] == -flags[3])
            return self._verdict(step, *flags[:2])
        previous = self._collect()
        flags_on_device = torch.stack(
            [self.step_nonfinite * float(count_nonfinite), torch.full((), float(signum), device=self.device)]
        )
        self.step_nonfinite = torch.zeros((), device=self.device)
        if self.distributed:
            dist.all_reduce(flags_on_device, op=dist.ReduceOp.MAX)
        self._host.copy_(flags_on_device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (step, event)
        return previous

    def keep_buffers(self, models: list[torch.nn.Module]) -> None:
        """With the streams compared: also copy these models' buffers at each agreement, by (the model's index, the
        buffer's state-dict name): what a survivor saves of the step (ddp_accel.rescue). The norm layers' running
        statistics are process 0's on every rank after the agreement."""
        if self.streams:
            self.buffers = [
                ((index, name), buffer) for index, model in enumerate(models) for name, buffer in model.named_buffers()
            ]
            shared = running_statistics(models)
            self.shared_buffers = [(key, buffer) for key, buffer in self.buffers if key in shared]
            size = sum(buffer.numel() for _, buffer in self.shared_buffers)
            self._host = torch.zeros(4 + size, dtype=torch.float64)

    def _fill_shared_buffers(self, into: torch.Tensor) -> None:
        """Process 0's statistics (exact in a float64), -inf from every other rank: the MAX is process 0's."""
        if self.accelerator.process_index == 0:
            torch.cat([buffer.detach().reshape(-1).to(torch.float64) for _, buffer in self.shared_buffers], out=into)
        else:
            into.fill_(-math.inf)

    def _shared_buffers(self, values: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
        found, start = {}, 0
        for key, buffer in self.shared_buffers:
            found[key] = values[start : start + buffer.numel()].reshape(buffer.shape).to(buffer.dtype, copy=True)
            start += buffer.numel()
        return found

    def flush(self) -> Verdict | None:
        """Wait for the newest submitted step's verdict (before a checkpoint or an evaluation)."""
        return self._collect()

    def _collect(self) -> Verdict | None:
        if self._pending is None:
            return None
        step, event = self._pending
        event.synchronize()
        self._pending = None
        return self._verdict(step, *self._host.tolist())

    @staticmethod
    def _verdict(step: int, nonfinite: float, signum: float) -> Verdict | None:
        name = signal.Signals(int(signum)).name if signum else None
        return Verdict(step, name, bool(nonfinite)) if nonfinite or signum else None
