"""Exact distributed evaluation (`evaluate`), and saved weights loaded for it under the run's identity
(`load_saved_weights`: a committed model, a best model, or a checkpoint)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from ddp_accel import loaders
from ddp_accel.checkpoint import resolve_resume
from ddp_accel.checkpoint_format import check_checkpoint, load_checkpoint, load_sharded_model, read_training_state
from ddp_accel.errors import UserError
from ddp_accel.identity import compare_identity, model_fingerprint
from ddp_accel.meters import EvalHistory, numbers
from ddp_accel.plain_ddp import load_weights
from ddp_accel.sharding import before_prepare
from ddp_accel.state import RunIdentity, TrainState
from ddp_accel.task import EvalFn, MetricsFn, Task


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


def metrics_text(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value:.4g}" for key, value in numbers(metrics).items())


class Evaluations:
    """A run's evaluations of its model: on a loader (every batch after `before_batch`, the run's stop check), an
    evaluation at a step recorded (the state's metrics, its line, history.json), and the test set."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        task: Task,
        history: EvalHistory,
        steps_per_epoch: int,
        before_batch: Callable[[], None],
    ):
        self.accelerator, self.model, self.task, self.history = accelerator, model, task, history
        self.steps_per_epoch, self.before_batch = steps_per_epoch, before_batch

    def __call__(self, loader: Any, prefix: str) -> dict[str, Any]:
        eval_fn, metrics_fn = self.task.eval_fn, self.task.metrics_fn
        assert eval_fn is not None, "an eval or test loader needs an eval_fn"
        return evaluate(self.accelerator, self.model, loader, eval_fn, metrics_fn, prefix, self.before_batch)

    def record(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """`metrics`, evaluated at the state's step: the state's last evaluation, one line, history.json."""
        state.eval_pending, state.last_eval_step, state.eval_metrics = False, state.step, metrics
        self.accelerator.print(f"step {state.step}: {metrics_text(metrics)}")
        samples = state.samples_trained
        epoch = samples / state.epoch_samples if state.epoch_samples else state.step / self.steps_per_epoch
        self.history.record(self.accelerator, state.step, samples, epoch, state.last_loss, metrics)

    def test(self, loader: Any) -> dict[str, Any]:
        metrics = self(loader, "test")
        self.accelerator.print(f"test: {metrics_text(metrics)}")
        return metrics


@dataclass(frozen=True)
class SavedWeights:
    """What load_saved_weights loaded: the prepared model, the file or checkpoint folder the weights came from, and
    the optimizer step they were saved at (None for a weights file, which records no step)."""

    model: torch.nn.Module
    source: Path
    step: int | None


def load_saved_weights(
    accelerator: Accelerator, model: torch.nn.Module, source: str, output_dir: Path, identity: dict[str, Any]
) -> SavedWeights:
    """The prepared `model` with saved weights: `source` is a .safetensors file (a run's model or best model), a
    step_N checkpoint folder, or `latest` (the newest checkpoint in OUTPUT_DIR/checkpoints). The options of
    `identity` (make_identity of the options that shape model and data) must match the ones the weights were
    trained with, where the run recorded them (metrics.json beside the file, the checkpoint): a model evaluated
    with another image size or normalisation gives a wrong figure, not an error. Data sources are not compared:
    evaluating on other data is what evaluation is for."""
    if source.endswith(".safetensors"):
        file = Path(source)
        if not file.is_file():
            raise UserError(f"--resume {source}: no such file")
        check_trained_with(file, identity)
        load_weights_file(model, file)
        return SavedWeights(prepare_for_evaluation(accelerator, model), file, None)
    path = resolve_resume(source, output_dir / "checkpoints", accelerator)
    if path is None:
        raise UserError(f"--resume latest: no complete checkpoint in {output_dir / 'checkpoints'}")
    state = read_training_state(path)
    saved = state.get("identity")
    if identity and saved:
        compare_identity(same_keys(saved, identity), identity, f"checkpoint {path}")
    run_identity = RunIdentity(model_fingerprint(model))  # the model's fingerprint is checked
    step = state.get("step")
    if accelerator.distributed_type == DistributedType.FSDP:  # the weights alone, into the bare model
        check_checkpoint(accelerator, path, run_identity)
        load_sharded_model(model, path)
        return SavedWeights(prepare_for_evaluation(accelerator, model), path, step)
    prepared = accelerator.prepare(model)
    load_checkpoint(accelerator, path, run_identity)
    return SavedWeights(prepared, path, step)


def prepare_for_evaluation(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """`model` prepared alone; under FSDP2, which prepares a model only with its optimizer, with a stand-in one
    that never steps."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return accelerator.prepare(model)
    before_prepare(accelerator, model)
    prepared, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    return prepared


def check_trained_with(
    file: Path, identity: dict[str, Any], remedy: str = "Use the same options and data, or another --output-dir"
) -> None:
    """The options `identity` names against those the run that wrote `file` trained with (its metrics.json beside
    it records them); weights from elsewhere are not checked."""
    committed = file.parent / "metrics.json"
    if not identity or not committed.is_file():
        return
    try:
        recorded = json.loads(committed.read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return
    if recorded:
        compare_identity(same_keys(recorded, identity), identity, f"the run that wrote {file}", remedy)


def same_keys(saved: dict[str, Any] | None, current: dict[str, Any]) -> dict[str, Any] | None:
    """`saved` identity with only the options `current` names (the data sources an evaluation leaves out)."""
    if not saved:
        return saved
    options = {key: value for key, value in saved.get("options", {}).items() if key in current.get("options", {})}
    return {**saved, "options": options}


def load_weights_file(model: torch.nn.Module, path: Path) -> None:
    """Weights of a .safetensors file into the bare model; one line when the file is not one or of another model."""
    try:
        weights = load_file(str(path))
    except Exception as error:  # safetensors' own error type: truncated or not a safetensors file
        raise UserError(f"--resume {path}: not a readable .safetensors file ({str(error).splitlines()[0]})") from None
    load_weights(model, weights, f"--resume {path}", f"this {type(model).__name__}")
