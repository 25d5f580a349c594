"""The end of a run: metrics.json's figures (`final_metrics`) and every final artifact committed at once
(`commit`): model.safetensors (unwrapped: no `module.` prefix), model_ema.safetensors, model_best.safetensors, the
script's own artifacts, args.json, training_curves.png and metrics.json (last: a run is complete once it exists
for its steps), written aside and moved into place together."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator

from ddp_accel import engines
from ddp_accel.budget import BudgetPlan, budget_line
from ddp_accel.callbacks import Callbacks
from ddp_accel.config import TrainConfig
from ddp_accel.context import RunContext
from ddp_accel.ema import WeightAverage
from ddp_accel.files import write_json, writing
from ddp_accel.meters import EvalHistory, numbers
from ddp_accel.plots import curves_wanted, plot_history
from ddp_accel.run_folder import RunFolder
from ddp_accel.runtime import exported_model, shards_weights, topology
from ddp_accel.state import RunIdentity, TrainState
from ddp_accel.stopping import Phase, StepAgreement, StopSignals
from ddp_accel.task import RunRecord
from ddp_accel.train_step import TrainStep
from ddp_accel.watchdog import ProgressWatchdog


class EndingRun(Protocol):
    """What the end reads of a run (ddp_accel.training.TrainingRun is one)."""

    accelerator: Accelerator
    config: TrainConfig
    record: RunRecord
    signals: StopSignals
    folder: RunFolder
    state: TrainState
    identity: RunIdentity
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: TrainStep
    agreement: StepAgreement
    callbacks: Callbacks
    context: RunContext
    watchdog: ProgressWatchdog
    history: EvalHistory
    ema: WeightAverage | None
    budget: BudgetPlan | None
    best_metric: str | None
    micro_batch: int
    accumulation: int
    test_metrics: dict[str, Any]
    hyperparameters: dict[str, Any]
    resumed_from: Path | None
    started: float
    wall_start: float


def final_metrics(run: EndingRun) -> dict[str, Any]:
    """metrics.json: the last evaluation and test, the loss, the throughput, the topology, the best metric."""
    state, best, budget, config = run.state, run.best_metric, run.budget, run.config
    planned = (
        {"time_budget": {**budget.state_dict(), "command_s": round(time.time() - run.started, 1)}} if budget else {}
    )
    return {
        **state.eval_metrics,
        **run.test_metrics,
        "train_loss": state.last_loss,
        "steps": state.step,
        "progress": state.progress(),  # how far, in a unit that does not change with the world size or batch
        "skipped_optimizer_steps": run.agreement.skipped_steps,
        "end_reason": state.end_reason(),
        **run.step.meter.summary(),
        "wall_time_s": time.perf_counter() - run.wall_start,
        **planned,
        "final_lr": run.optimizer.param_groups[0]["lr"],  # where the schedule ended (a plateau's decays)
        **topology(run.accelerator, run.micro_batch, run.accumulation),
        **({"auto_batch_size": f"{config.batch_size} asked, {run.micro_batch} fits"} if config.auto_batch_size else {}),
        "resumed_from": str(run.resumed_from) if run.resumed_from else None,
        **({"best_" + best.removeprefix("eval_"): state.best_metric} if best else {}),
        **run.record.extra_metrics,
        "identity": run.identity.identity or None,
    }


def commit(run: EndingRun) -> dict[str, Any]:
    """Every rank: the final artifacts, then the last lines. Signals received now are noted, not acted on: the
    commit is short, and a run stopped in it would have to redo it. Returns metrics.json."""
    run.signals.enter(Phase.COMMIT)
    run.watchdog.stop()  # it watches training and evaluation; the commit writes files once
    accelerator, folder = run.accelerator, run.folder
    metrics = final_metrics(run)
    curves = bool(run.history.records) and curves_wanted()
    accelerator.wait_for_everyone()
    final = folder.staging / "model"
    with writing(final, cleanup=final):
        # rank 0 writes the weights, which every rank holds whole but under FSDP, whose gather needs every rank
        if shards_weights(accelerator) or accelerator.is_main_process:
            accelerator.save_model(exported_model(accelerator, run.model), str(final))
        accelerator.wait_for_everyone()  # every rank is done with the folder before it goes
        if accelerator.is_main_process:
            if run.ema is not None:
                folder.stage_weights("model_ema.safetensors", run.ema.weights())
            if curves:
                plot_history(run.history.records, folder.staging / "training_curves.png", run.record.title)
            write_json(folder.staging / "args.json", run.hyperparameters)
            folder.commit(final, run.record.artifacts, metrics)
    engines.note_metrics(metrics)
    run.callbacks.call("on_end", run.context, metrics)
    run.signals.enter(Phase.DONE)
    accelerator.print(summary_line(metrics, folder.path, curves))
    if run.budget is not None:
        accelerator.print(budget_line(run.budget, time.time() - run.started, run.resumed_from is not None))
    return metrics


def summary_line(metrics: dict[str, Any], output_dir: Path, curves: bool) -> str:
    """The last line of a run: what it reached and where its outputs are."""
    written = "model.safetensors, metrics.json" + (" and training_curves.png" if curves else "")
    scores = ", ".join(
        f"{key} {value:.4g}"
        for key, value in numbers(metrics).items()
        if key.startswith(("eval_", "test_", "ema_")) and not key.endswith("_samples")
    )
    return (
        f"done: {metrics['steps']} steps in {metrics['wall_time_s']:.0f} s on {metrics['world_size']} process(es)"
        f"{'; ' + scores if scores else ''}; {written} in {output_dir}"
    )
