"""The stateful callbacks' part of a checkpoint (a component of ddp_accel.checkpoint_format), by name:
`callback_states.pt` maps each callback's `state_key` to its `state_dict()`, so that adding or removing a callback
never hands another one the wrong state.

Checkpoints of earlier versions hold the states by position instead (Accelerate's
`custom_checkpoint_N.pkl`, in the order the stateful callbacks were given): they are read in that order, and a
count that differs is refused as it was then.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp_accel.errors import UserError

STATES_FILE = "callback_states.pt"
POSITIONAL = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")


def other_callbacks(path: Path, detail: str) -> UserError:
    return UserError(
        f"checkpoint {path} was written with other stateful callbacks than this run has ({detail}; --ema-decay given "
        "on one side only?): resume with the same options, or start a new run from its model.safetensors"
    )


class CallbackStates:
    """The stateful callbacks of a run (ddp_accel.callbacks.Callback with state_dict/load_state_dict), by key
    (`state_key`, else the class name; a second of the same key gets `#2`), in the order they were given."""

    name = "callbacks"
    each_rank: str | None = None  # every rank's callbacks hold the same state (as Accelerate's custom states were)

    def __init__(self, callbacks: list[Any]):
        self.by_key: dict[str, Any] = {}
        for callback in callbacks:
            if not hasattr(callback, "state_dict"):
                continue
            key = callback.state_key or type(callback).__name__
            unique, count = key, 2
            while unique in self.by_key:
                unique, count = f"{key}#{count}", count + 1
            self.by_key[unique] = callback

    def save(self, folder: Path, rank: int, ranks: int, save: Callable[[Any, Path], None] = torch.save) -> None:
        """The main process (rank 0); `save`: torch.save, or an asynchronous checkpoint's staging."""
        if rank != 0:
            return
        states = {key: callback.state_dict() for key, callback in self.by_key.items()}
        required = [key for key, callback in self.by_key.items() if callback.state_required]
        save({"states": states, "required": required}, folder / STATES_FILE)

    def load(self, path: Path, rank: int = 0, ranks: int = 1) -> list[str]:
        """Each callback's state by its key (by position from a checkpoint of an earlier version). Returns notes to
        show."""
        positional = positional_files(path)
        if positional:
            return self._load_positional(path, [torch.load(path / name, weights_only=False) for name in positional])
        if (path / STATES_FILE).is_file():
            return self._load_by_key(path, torch.load(path / STATES_FILE, weights_only=False))
        return self._load_by_key(path, {"states": {}, "required": []})

    def _load_positional(self, path: Path, states: list[Any]) -> list[str]:
        if len(states) != len(self.by_key):
            raise other_callbacks(path, f"{len(states)} saved by position, {len(self.by_key)} here")
        for callback, state in zip(self.by_key.values(), states, strict=True):
            callback.load_state_dict(state)
        return []

    def _load_by_key(self, path: Path, saved: dict[str, Any]) -> list[str]:
        states, required = saved["states"], set(saved["required"])
        missing_required = [
            key for key, callback in self.by_key.items() if callback.state_required and key not in states
        ]
        unused_required = sorted(required - set(self.by_key))
        if missing_required or unused_required:
            detail = (
                f"no state of {', '.join(missing_required)} saved"
                if missing_required
                else f"the state of {', '.join(unused_required)} saved, no such callback here"
            )
            raise other_callbacks(path, detail)
        notes = []
        for key, callback in self.by_key.items():
            if key in states:
                callback.load_state_dict(states[key])
            else:
                notes.append(f"checkpoint {path} holds no state of the callback {key}: it starts afresh")
        notes += [
            f"checkpoint {path} holds the state of a callback this run does not have ({key}): left unused"
            for key in sorted(set(states) - set(self.by_key))
        ]
        return notes


def positional_files(path: Path) -> list[str]:
    """An earlier version's callback states (Accelerate's `custom_checkpoint_N.pkl`), in their order."""
    try:
        names = [entry.name for entry in path.iterdir()]
    except OSError:
        return []
    found = [(int(match.group(1)), name) for name in names if (match := POSITIONAL.match(name))]
    return [name for _, name in sorted(found)]
