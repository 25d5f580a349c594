"""Mixup and CutMix (torchvision.transforms.v2) with draws that a resume reproduces.

torchvision's MixUp and CutMix draw the mixing weight, the box and the choice between them from torch's global
generator, whose state depends on everything drawn before (dropout, and a process's history). Here each batch's
draws come from a seed of its own, the run's seed and the batch's position in training (the optimizer step and
the micro-batch within gradient accumulation), the same on every rank: a run resumed mid-epoch, on another worker
count or world size, mixes each batch as the uninterrupted run did. Under --exact-micro-batch each piece is mixed
alone, from its own piece's seed. The global generator is put back afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torchvision.transforms import v2

from ddp_accel.callbacks import Callback
from ddp_accel.exact_reduction import piece_in_progress

if TYPE_CHECKING:
    from ddp_accel.context import RunContext


class BatchMixing(Callback):
    """`images, soft_targets = mixing(images, targets)` in a loss function; pass the object to `fit(callbacks=...)`
    so that it knows the position in training. `probability`: the share of batches mixed; with both alphas above
    0, CutMix is chosen for a mixed batch with `switch_probability` (timm's defaults: 1.0 and 0.5)."""

    def __init__(
        self,
        num_classes: int,
        seed: int,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        probability: float = 1.0,
        switch_probability: float = 0.5,
    ) -> None:
        self.num_classes, self.seed, self.probability = num_classes, seed, probability
        choices: list[Any] = []
        weights: list[float] = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
            weights.append(1 - switch_probability if cutmix_alpha > 0 else 1.0)
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
            weights.append(switch_probability if mixup_alpha > 0 else 1.0)
        self.mix = v2.RandomChoice(choices, p=weights) if choices else None
        self.step, self.micro_batch = 0, 0
        self._run: RunContext | None = None

    @property
    def active(self) -> bool:
        return self.mix is not None

    def on_start(self, run: RunContext) -> None:
        self._run, self.step, self.micro_batch = run, run.state.step, 0  # a trial batch (--auto-batch-size) before

    def position(self) -> tuple[int, int]:
        """(optimizer step, micro-batch within it) of the batch about to be mixed."""
        step = self._run.state.step if self._run is not None else self.step
        if step != self.step:
            self.step, self.micro_batch = step, 0
        micro_batch = self.micro_batch
        self.micro_batch += 1
        return step, micro_batch

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mix is None:
            return images, targets
        step, micro_batch = self.position()
        state = torch.default_generator.get_state()
        piece = piece_in_progress()  # --exact-micro-batch: a piece of the global batch, wherever it is computed
        torch.default_generator.manual_seed(
            ((self.seed * 100_003 + step) * 1_009 + micro_batch) % 2**63 if piece is None else piece
        )
        try:
            if torch.rand(()) >= self.probability:  # unmixed: the same one-hot form for the loss
                return images, torch.nn.functional.one_hot(targets, self.num_classes).to(images.dtype)
            mixed_images, mixed_targets = self.mix(images, targets)
            return mixed_images, mixed_targets
        finally:
            torch.default_generator.set_state(state)
