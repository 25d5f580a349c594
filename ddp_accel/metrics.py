"""Classification metrics, computed from per-sample values so that `evaluate` can gather them exactly once.

Names: `accuracy` (top-1) for the text and template jobs; `top1`/`top5` for ImageFolder, as users of
pytorch/examples' imagenet/main.py know them. The same names go to metrics.json, history.json, the progress
output and every tracker (with an `eval_`/`test_` prefix there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def classification_values(
    logits: torch.Tensor, targets: torch.Tensor, *, topk: Sequence[int] = (), per_class: bool = False
) -> dict[str, torch.Tensor]:
    """Per-sample values of one batch: `loss` (cross-entropy) and whether the target was in the top k.

    With `topk=()` top-1 is called `accuracy`; with `topk=(1, 5)` the keys are `top1` and `top5` (a k that is
    not smaller than the number of classes is left out: top-5 of 3 classes means nothing). `per_class` adds the
    targets, which `classification_metrics` needs for per-class top-1.
    """
    logits = logits.float()
    values = {"loss": torch.nn.functional.cross_entropy(logits, targets, reduction="none")}
    ks = [k for k in topk if k == 1 or k < logits.shape[1]] or [1]
    ranked = logits.topk(max(ks), dim=1).indices
    for k in ks:
        name = f"top{k}" if topk else "accuracy"
        values[name] = (ranked[:, :k] == targets[:, None]).any(dim=1).float()
    if per_class:
        values["target"] = targets
    return values


def classification_names(classes: int, topk: Sequence[int] = ()) -> tuple[str, ...]:
    """The numbers `classification_metrics` reports for `classification_values(..., topk=topk)` of `classes`
    classes (a Task's `metric_names`: --best-metric is checked against them before the first step)."""
    ks = [k for k in topk if k == 1 or k < classes] or [1]
    return ("loss", *(f"top{k}" if topk else "accuracy" for k in ks))


def classification_metrics(values: dict[str, torch.Tensor], classes: Sequence[str] | None = None) -> dict:
    """The mean of every per-sample value, and top-1 of each class (`per_class_accuracy` or `per_class_top1`,
    keyed by class name) when the targets were kept."""
    metrics: dict[str, Any] = {key: value.float().mean().item() for key, value in values.items() if key != "target"}
    if "target" in values:
        top1 = "top1" if "top1" in values else "accuracy"
        names = classes if classes is not None else [str(i) for i in range(int(values["target"].max()) + 1)]
        metrics[f"per_class_{top1}"] = {
            name: values[top1][values["target"] == index].mean().item()
            for index, name in enumerate(names)
            if (values["target"] == index).any()
        }
    return metrics
