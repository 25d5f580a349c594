"""An exponential moving average of the weights (`--ema-decay`), under the exact-resume guarantee.

After each optimizer step: ema = decay * ema + (1 - decay) * weights, for every floating-point parameter and
buffer (integer buffers such as BatchNorm's counter are copied). Under DDP every rank holds the same weights after
a step, so every rank updates the same average without communication. The average is a `Callback` with
`state_dict`/`load_state_dict`: it is saved in every checkpoint and resumed bit for bit. fit evaluates it beside
the raw weights (`ema_*` metrics), can choose the best model by one of them (`--best-metric ema_top1`), and
commits it as `model_ema.safetensors`, which loads into the bare model like `model.safetensors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ddp_accel.callbacks import Callback

if TYPE_CHECKING:
    from ddp_accel.context import RunContext
    from ddp_accel.state import Rebase


class WeightAverage(Callback):
    """The EMA of one model's weights; `warmup`: decay min(decay, (1 + t) / (10 + t)) at update t, so that the
    first steps' random weights fade fast (TensorFlow's `num_updates` form)."""

    state_key = "ema"
    state_required = True  # a run with the average on one side of a resume only would be another run

    def __init__(self, decay: float, warmup: bool = False):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the EMA decay must be in (0, 1), not {decay}")
        self.decay, self.warmup = decay, warmup
        self.updates = 0
        self.average: dict[str, torch.Tensor] = {}
        self.live: dict[str, torch.Tensor] = {}

    # --- saved in every checkpoint (accelerate's register_for_checkpointing) ---
    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "average": self.average}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates, self.average = state["updates"], state["average"]

    # --- the hooks ---
    def on_start(self, run: RunContext) -> None:
        # the model's own tensors (a state dict's values share their storage), read at every step: optimizer
        # steps, buffer updates and the evaluation's swap all write into them in place
        self.live = run.exported_model().state_dict()
        if not self.average:  # a new run; a resumed one loaded its average before this hook
            self.average = {name: value.detach().clone() for name, value in self.live.items()}
        else:
            device = next(iter(self.live.values())).device
            self.average = {name: value.to(device) for name, value in self.average.items()}

    def on_rebase(self, run: RunContext, rebase: Rebase) -> None:
        # --ema-warmup's position: updates are optimizer steps, counted again in this command's steps
        self.updates = rebase.steps_now(self.updates)

    @torch.no_grad()
    def on_step_end(self, run: RunContext) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup else self.decay
        for name, value in self.live.items():
            average = self.average[name]
            if average.is_floating_point() or average.is_complex():
                average.mul_(decay).add_(value, alpha=1 - decay)
            else:
                average.copy_(value)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.average

    def extra_evaluation(self, run: RunContext) -> dict[str, Any]:
        """The eval loader's metrics of the averaged weights (`ema_*`), the raw weights put back after."""
        model = run.exported_model()
        raw = {name: value.detach().clone() for name, value in model.state_dict().items()}
        model.load_state_dict(self.average)
        try:
            return run.evaluate("ema")
        finally:
            model.load_state_dict(raw)
