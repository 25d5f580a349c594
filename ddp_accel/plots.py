"""Training curves as a PNG next to metrics.json, for people who would rather look than read."""

from __future__ import annotations

import os
from pathlib import Path

from ddp_accel.files import replaced_atomically

CURVES_VARIABLE = "DDP_ACCEL_CURVES"


def curves_wanted() -> bool:
    """training_curves.png is drawn at the end of a run unless DDP_ACCEL_CURVES=0: sweeps and CI jobs that never
    look at it save matplotlib's half second of CPU (its import and one plot) at every run's end."""
    return os.environ.get(CURVES_VARIABLE, "").strip().lower() not in ("0", "false", "no", "off")


def plot_history(history: list[dict], path: str | Path, title: str = "") -> None:
    """Left: training and evaluation loss; right: every other evaluation metric in [0, 1] (accuracies).

    Drawn on a bare Agg figure (no pyplot: no global figure manager) with a fixed layout: matplotlib's
    tight_layout measured every text first and took a third of the plot's time, at the end of every run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    epochs = [record["epoch"] for record in history]
    losses = [key for key in ("train_loss", "eval_loss") if any(key in record for record in history)]
    scores = sorted(
        {
            key
            for record in history
            for key, value in record.items()
            if key.startswith("eval_")
            and key != "eval_loss"
            and key != "eval_samples"
            and isinstance(value, float)
            and 0.0 <= value <= 1.0
        }
    )
    figure = Figure(figsize=(11, 4))
    FigureCanvasAgg(figure)
    loss_axis, score_axis = figure.subplots(1, 2)
    for key in losses:
        loss_axis.plot(epochs, [record.get(key, float("nan")) for record in history], marker="o", label=key)
    for key in scores:
        score_axis.plot(epochs, [record.get(key, float("nan")) for record in history], marker="o", label=key)
    for axis, name in ((loss_axis, "loss"), (score_axis, "evaluation")):
        axis.set_xlabel("epoch")
        axis.set_title(name)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend()
    figure.suptitle(title)
    figure.subplots_adjust(left=0.06, right=0.98, bottom=0.13, top=0.85, wspace=0.15)
    with replaced_atomically(path) as partial:
        figure.savefig(partial, dpi=100, format="png")
