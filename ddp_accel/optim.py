"""Optimizers for models with sparse embedding gradients: a lazy AdamW for the tables, and several optimizers
handed to Accelerate (and fit) as one."""

from __future__ import annotations

from typing import Any

import torch


class SparseAdamW(torch.optim.SparseAdam):
    """SparseAdam with decoupled weight decay applied lazily: only the rows a batch touched are decayed (by
    `1 - lr * weight_decay`), like the Adam moments SparseAdam keeps, so a step costs the rows of the batch, not
    the whole table. (torch's AdamW refuses sparse gradients; SparseAdam has no weight decay.)"""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps)
        for group in self.param_groups:
            group.setdefault("weight_decay", weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if group["weight_decay"]:
                for param in group["params"]:
                    if param.grad is not None:
                        rows = param.grad.coalesce().indices()[0].unique()
                        param.index_copy_(0, rows, param.index_select(0, rows) * (1 - group["lr"] * group["weight_decay"]))
        return super().step(closure)


class Optimizers(torch.optim.Optimizer):
    """Several optimizers as one: their parameter groups side by side (an LR scheduler scales them all), one
    step, one zero_grad, one state dict. Accelerate's `prepare` and its gradient scaler treat it as any optimizer."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers
        # not Optimizer.__init__: the groups are the inner optimizers' own dicts, so changes reach them
        self.param_groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        self.defaults = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @property
    def state(self) -> dict:
        return {param: value for optimizer in self.optimizers for param, value in optimizer.state.items()}

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"]):
            optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Optimizers({', '.join(type(optimizer).__name__ for optimizer in self.optimizers)})"
