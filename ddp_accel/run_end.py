"""The end of a run: metrics.json's figures (`final_metrics`), every final artifact committed at once (`commit`):
model.safetensors (unwrapped: no `module.` prefix), model_ema.safetensors, model_best.safetensors, the script's own
artifacts, args.json, training_curves.png and metrics.json (last: a run is complete once it exists for its steps),
written aside and moved into place together; or the end of a stopped run (`stop_here`). Each takes what it reads."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from accelerate import Accelerator

from ddp_accel.agreement import Verdict
from ddp_accel.checkpoint import Checkpoints
from ddp_accel.ema import WeightAverage
from ddp_accel.files import write_json, writing
from ddp_accel.meters import EvalHistory, numbers
from ddp_accel.plots import curves_wanted, plot_history
from ddp_accel.run_folder import RunFolder
from ddp_accel.runtime import exported_model, shards_weights
from ddp_accel.state import RunIdentity, TrainState
from ddp_accel.stopping import Preempted, StopFacts, StopSignals
from ddp_accel.task import RunRecord


def final_metrics(
    state: TrainState,
    test_metrics: dict[str, Any],
    trained: dict[str, Any],
    best_metric: str | None,
    record: RunRecord,
    identity: RunIdentity,
) -> dict[str, Any]:
    """metrics.json: the last evaluation and test, the loss, how far, how it trained (`trained`: the loop's figures,
    the topology), the best metric, the script's own figures."""
    return {
        **state.eval_metrics,
        **test_metrics,
        "train_loss": state.last_loss,
        "steps": state.step,
        "progress": state.progress(),  # how far, in a unit that does not change with the world size or batch
        "end_reason": state.end_reason(),
        **trained,
        **(
            {"best_" + best_metric.removeprefix("eval_"): state.best_metric, "best_metric": best_metric}
            if best_metric
            else {}
        ),
        **record.extra_metrics,
        "identity": identity.identity or None,
    }


@dataclass(frozen=True)
class FinalArtifacts:
    """What the commit writes besides metrics.json: the weights (and their average), the curves, args.json."""

    model: torch.nn.Module
    ema: WeightAverage | None
    history: EvalHistory
    record: RunRecord  # the title of the curves, the script's artifacts
    hyperparameters: dict[str, Any]


def commit(accelerator: Accelerator, folder: RunFolder, metrics: dict[str, Any], final: FinalArtifacts) -> bool:
    """Every rank: the final artifacts and metrics.json, moved into the folder together. Returns whether
    training_curves.png is among them."""
    curves = bool(final.history.records) and curves_wanted()
    accelerator.wait_for_everyone()
    weights = folder.staging / "model"
    with writing(weights, cleanup=weights):
        # rank 0 writes the weights, which every rank holds whole but under FSDP, whose gather needs every rank
        if shards_weights(accelerator) or accelerator.is_main_process:
            accelerator.save_model(exported_model(accelerator, final.model), str(weights))
        accelerator.wait_for_everyone()  # every rank is done with the folder before it goes
        if accelerator.is_main_process:
            if final.ema is not None:
                folder.stage_weights("model_ema.safetensors", final.ema.weights())
            if curves:
                plot_history(final.history.records, folder.staging / "training_curves.png", final.record.title)
            write_json(folder.staging / "args.json", final.hyperparameters)
            folder.commit(weights, final.record.artifacts, metrics)
    return curves


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


def stop_here(
    accelerator: Accelerator,
    verdict: Verdict,
    signals: StopSignals,
    checkpoints: Checkpoints,
    state: TrainState,
    identity: RunIdentity,
    folder: RunFolder,
) -> NoReturn:
    """Every rank, on a preemption: checkpoint the step reached (unless it was just saved), leave the marker
    (preempted.json), raise Preempted."""
    started, phase = time.perf_counter(), signals.phase
    path = checkpoints.save_reached(state, identity)
    facts = StopFacts(phase, verdict.signal, state.step, str(path), round(time.perf_counter() - started, 2))
    if accelerator.is_main_process:
        facts.write(folder.path)
    accelerator.wait_for_everyone()  # no process exits (and makes a launcher kill the rest) before the marker
    if signals.received is None:  # the signal reached a peer: it may still be on its way to this process
        time.sleep(1.0)
    raise Preempted(facts, by_peer=signals.received is None)
