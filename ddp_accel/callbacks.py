"""How a feature hooks into `fit` without a branch in its loop: a `Callback` (Lightning Fabric's `fabric.call`
pattern). fit's own progress bar and trackers are callbacks; pass yours with `fit(..., callbacks=[...])`.

Every rank calls every hook at the same point, in the order the callbacks were given. A callback with
`state_dict()`/`load_state_dict()` is saved in every checkpoint and restored on resume by its `state_key`
(ddp_accel.callback_state), so what it keeps resumes exactly.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tqdm.auto import tqdm

from ddp_accel.errors import UserError
from ddp_accel.meters import improves, numbers, scalars
from ddp_accel.tracking import TrackerLog

if TYPE_CHECKING:
    from ddp_accel.context import RunContext
    from ddp_accel.state import Rebase


class Callback:
    """Override the hooks you need; `run` is the run's `RunContext` (its `state`, `accelerator`, `model`,
    `optimizer`, `folder`, `exported_model()`, `evaluate(prefix)`): what a feature may see, never the loop.

    A callback with `state_dict()`/`load_state_dict()` is saved in every checkpoint under its `state_key` (its class
    name unless set) and given back by that key at a resume: adding or removing a callback never shifts another's
    state. `state_required`: a checkpoint without this state (or one holding it, for a run without the callback)
    cannot continue the run (the weights' average: one side only would be another run).

    A callback that draws from random generators of its own names them in `random_generators()`: the ranks
    compare them at each step with Accelerate's, so that a survivor of a lost peer saves a checkpoint only where
    its generators are every rank's (its `state_dict` saves them, as process 0 holds them)."""

    state_key: str | None = None
    state_required: bool = False

    def random_generators(self) -> dict[str, Any]:
        """name -> a torch.Generator, numpy Generator or RandomState, or random.Random this callback draws from."""
        return {}

    def on_start(self, run: RunContext) -> None:
        """After the resume, before the first step of this process."""

    def on_rebase(self, run: RunContext, rebase: Rebase) -> None:
        """A resume at another global batch or accumulation counts steps again (`rebase.steps_now` converts a
        count of the checkpoint's steps): whatever the callback counts in optimizer steps must follow."""

    def on_step_end(self, run: RunContext) -> None:
        """After each optimizer step (`run.state.step` counts it), before a stop is agreed and before its log,
        evaluation and checkpoint: what a step updates here belongs to the step, and a stop saves it whole."""

    def on_log(self, run: RunContext, logs: dict[str, Any]) -> None:
        """Each log window: the loss, throughput and learning rate (add your own values to `logs`)."""

    def extra_evaluation(self, run: RunContext) -> dict[str, Any]:
        """More metrics for each evaluation, measured on the same data (the weights' average: `ema_*`)."""
        return {}

    def on_evaluate(self, run: RunContext, metrics: dict[str, Any]) -> None:
        """After each evaluation on the eval loader (every rank has the same metrics)."""

    def on_epoch_end(self, run: RunContext) -> None:
        """After an epoch and its evaluation, before its checkpoint (`run.state.epoch`: the epochs done)."""

    def on_checkpoint(self, run: RunContext, path: Path) -> None:
        """After a checkpoint was saved and renamed into place (a launch environment can report it)."""

    def on_end(self, run: RunContext, metrics: dict[str, Any]) -> None:
        """After the final artifacts were committed; `metrics` is metrics.json."""

    def on_close(self, run: RunContext) -> None:
        """When fit returns or raises (a preemption, an error): release what the callback holds."""


class Callbacks:
    """The callbacks of one run, called in order, every rank at the same point."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = callbacks
        self._bound: dict[str, list[Any]] = {}

    def stateful(self) -> list[Callback]:
        return [callback for callback in self.callbacks if hasattr(callback, "state_dict")]

    def call(self, hook: str, run: RunContext, *args: Any) -> None:
        bound = self._bound.get(hook)
        if bound is None:  # only the callbacks that do something there: some hooks run at every step
            bound = self._bound[hook] = [
                getattr(callback, hook)
                for callback in self.callbacks
                if getattr(type(callback), hook, None) is not getattr(Callback, hook) or hook in vars(callback)
            ]
        for method in bound:
            method(run, *args)

    def random_generators(self) -> dict[str, Any]:
        """Every callback's generators, by `state_key` (else class name) and the callback's own name."""
        return {
            f"{callback.state_key or type(callback).__name__}.{name}": generator
            for callback in self.callbacks
            for name, generator in callback.random_generators().items()
        }

    def extra_evaluation(self, run: RunContext) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        for callback in self.callbacks:
            metrics.update(callback.extra_evaluation(run))
        return metrics


class LinePerRedraw:
    """tqdm's stream in a log file: each redraw (tqdm writes a carriage return, the bar, padding) becomes a line of
    its own. SLURM and `kubectl logs` readers, `tail -f` and grep take a log line by line: redrawn in place, the
    bar reached them only with the newline tqdm writes when it closes."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.strip("\r\n ")
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


class ProgressBar(Callback):
    """The step counter of the local main process: redrawn per step on a terminal, a line every 30 s in a log
    file; the last log window's loss, throughput and data wait as its postfix."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        # a terminal on either stream: a one-process `accelerate launch` (1.16 and later) pipes the script's stderr
        # through itself onto the terminal, where stdout still is
        self.interactive = sys.stderr.isatty() or sys.stdout.isatty()

    def on_start(self, run: RunContext) -> None:
        self.bar = tqdm(
            total=run.total_steps,
            initial=run.state.step,
            disable=not run.accelerator.is_local_main_process,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=0.1 if self.interactive else 30,
            file=None if self.interactive else LinePerRedraw(sys.stderr),
        )

    def on_step_end(self, run: RunContext) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, run: RunContext, logs: dict[str, Any]) -> None:
        postfix = {
            "loss": f"{logs['train_loss']:.4f}",
            "samples_s": f"{logs['samples_per_s']:.0f}",
            "data_wait": f"{logs['data_wait_share']:.0%}",
            "epoch": logs["epoch"],
        }
        if "skipped_optimizer_steps" in logs:
            postfix["skipped"] = logs["skipped_optimizer_steps"]
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=self.interactive)

    def on_end(self, run: RunContext, metrics: dict[str, Any]) -> None:
        self.on_close(run)

    def on_close(self, run: RunContext) -> None:
        if self.bar is not None:
            self.bar.close()  # an error line then starts on a line of its own
            self.bar = None


class Trackers(Callback):
    """TensorBoard / MLflow / W&B (the Accelerator's trackers): the log windows, every evaluation and the final
    metrics, one tracker run across resumes. Their x axis is the samples trained (`TrainState.samples_trained`),
    which only grows across a resize, while optimizer steps are counted again in steps of the new global batch;
    the step is logged as `optimizer_step`. A slow tracker server is waited for under the watchdog's generous
    bound, not taken for a hang."""

    def __init__(self) -> None:
        self.log: TrackerLog | None = None

    def on_start(self, run: RunContext) -> None:
        self.log = TrackerLog(
            run.accelerator,
            run.folder.path,
            scalars(run.hyperparameters),
            resumed=run.resumed_from is not None,
        )

    def _log(self, run: RunContext, values: dict[str, Any]) -> None:
        assert self.log is not None
        with run.slow_on_main("logging to the trackers", self.log.active):
            self.log.log({**values, "optimizer_step": run.state.step}, run.state.samples_trained)

    def on_log(self, run: RunContext, logs: dict[str, Any]) -> None:
        self._log(run, logs)

    def on_evaluate(self, run: RunContext, metrics: dict[str, Any]) -> None:
        self._log(run, metrics)

    def on_end(self, run: RunContext, metrics: dict[str, Any]) -> None:
        assert self.log is not None
        self.log.log({f"final_{key}": value for key, value in numbers(metrics).items()}, run.state.samples_trained)
        self.log.finish([run.folder.path / "model.safetensors", run.folder.path / "training_curves.png"])


class Averaged(Protocol):
    def weights(self) -> dict[str, Any]: ...


class BestModel(Callback):
    """model_best.safetensors: the weights of the best evaluation so far by `metric` (higher is better, lower for a
    `*loss`), staged until the commit; an `ema_*` metric stages the averaged weights (`average`: --ema-decay). The
    best value and its step are in TrainState: they resume with it."""

    def __init__(self, metric: str | None, average: Averaged | None = None):
        self.metric, self.average = metric, average

    def on_evaluate(self, run: RunContext, metrics: dict[str, Any]) -> None:
        if not self.metric:
            return
        if self.metric not in metrics:
            names = ", ".join(key for key, value in numbers(metrics).items() if not key.endswith("_samples"))
            raise UserError(f"--best-metric {self.metric} is not a metric of this run's evaluation: {names}")
        state, value = run.state, metrics[self.metric]
        if not isinstance(value, int | float) or not math.isfinite(value):  # a nan evaluation is never the best
            return
        if not improves(self.metric, value, state.best_metric):
            return
        with run.slow_on_main("saving the best model"):
            state.best_metric, state.best_step = value, state.step
            average = self.average if self.metric.startswith("ema_") else None
            weights = average.weights() if average is not None else run.accelerator.get_state_dict(run.exported_model())
            if run.accelerator.is_main_process:  # every rank above: the full weights are gathered under FSDP
                run.folder.stage_best(weights)


class EarlyStopping(Callback):
    """--early-stopping-patience: an evaluation that does not improve `metric` by more than `min_delta` counts;
    after `patience` of them in a row training ends. Every rank has the same metrics (gathered), so every rank
    decides the same at the same step; the count is in the training state (checkpoints)."""

    def __init__(self, metric: str, patience: int, min_delta: float = 0.0):
        self.metric, self.patience, self.min_delta = metric, patience, min_delta

    def on_evaluate(self, run: RunContext, metrics: dict[str, Any]) -> None:
        state, name, delta = run.state, self.metric, self.min_delta
        value = metrics.get(name)
        if isinstance(value, int | float) and math.isfinite(value):
            if improves(name, value, state.early_stopping_best, delta):
                state.early_stopping_best, state.evaluations_without_improvement = float(value), 0
                return
        state.evaluations_without_improvement += 1
        if state.evaluations_without_improvement >= self.patience:
            state.stopped_early = True
            run.accelerator.print(
                f"early stopping at step {state.step}: {name} has not improved by more than {delta:g} for "
                f"{state.evaluations_without_improvement} evaluations (best {state.early_stopping_best})"
            )
