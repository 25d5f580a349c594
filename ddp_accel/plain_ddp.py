"""Checkpoints of classic DDP scripts (`torch.save({"model_state_dict": ..., ...})`, keys with or without
DDP's `module.` prefix) into a bare model: what a user migrating from a plain DDP recipe brings along."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddp_accel.errors import UserError


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str, target: str) -> None:
    """`weights` into `model`; weights of another model are one line: `{source} holds weights of another model
    than {target} (the first mismatch)`."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        lines = str(error).splitlines()
        first = lines[1].strip() if len(lines) > 1 else lines[0]
        raise UserError(f"{source} holds weights of another model than {target} ({first})") from None


def strip_module_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DDP saves `module.layer.weight`; the bare model wants `layer.weight`."""
    prefix = "module."
    if state_dict and all(key.startswith(prefix) for key in state_dict):
        return {key[len(prefix) :]: value for key, value in state_dict.items()}
    return state_dict


def load_plain_ddp_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint written by a classic DDP script into an unwrapped model.

    Accepts `{'epoch', 'step', 'model_state_dict', 'optimizer_state_dict', ...}` or a bare state dict,
    with or without the `module.` prefix. Returns the remaining entries (epoch, step, loss...).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickles with arbitrary objects are refused by weights_only
        raise UserError(f"{path}: cannot be loaded safely with weights_only=True ({type(error).__name__})") from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"{path}: expected a dict checkpoint, found {type(checkpoint).__name__}")
    model_state = checkpoint.get("model_state_dict", checkpoint)
    try:
        model.load_state_dict(strip_module_prefix(model_state))
    except RuntimeError as error:
        raise UserError(
            f"{path} does not fit this model: {str(error).splitlines()[0]} "
            f"{str(error).splitlines()[1].strip() if len(str(error).splitlines()) > 1 else ''}"
        ) from None
    if optimizer is not None and "optimizer_state_dict" in checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    return {key: value for key, value in checkpoint.items() if key not in ("model_state_dict", "optimizer_state_dict")}
