"""ddp-accel: classic PyTorch DDP recipes as Hugging Face Accelerate training scripts.

The front door: scripts import from here (and from the domain packages `ddp_accel.vision`, `ddp_accel.text`).
Each name is imported when first used (PEP 562): `import ddp_accel.startup` at a script's top costs no torch import,
so a preemption signal during the imports is handled at once (ddp_accel/startup.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddp_accel import cli
    from ddp_accel.callbacks import Callback
    from ddp_accel.cli import ArgumentParser
    from ddp_accel.config import TrainConfig, add_training_args
    from ddp_accel.elastic import process_rank
    from ddp_accel.endings import run_main
    from ddp_accel.errors import UserError
    from ddp_accel.evaluation import check_trained_with, evaluate, load_saved_weights, load_weights_file
    from ddp_accel.files import write_json
    from ddp_accel.identity import make_identity
    from ddp_accel.metrics import classification_metrics, classification_names, classification_values
    from ddp_accel.notebook import launched
    from ddp_accel.optim import Optimizers, SparseAdamW, make_optimizer
    from ddp_accel.runtime import build_accelerator, check_memory, make_accelerator, print_banner
    from ddp_accel.stopping import Preempted, StopSignals
    from ddp_accel.streaming import ShardManifest, ShardReader, WindowShuffle
    from ddp_accel.sync_bn import convert_sync_batchnorm
    from ddp_accel.task import RunRecord, Task
    from ddp_accel.training import Run, fit

_EXPORTS = {
    "ArgumentParser": "ddp_accel.cli",
    "Callback": "ddp_accel.callbacks",
    "Optimizers": "ddp_accel.optim",
    "Preempted": "ddp_accel.stopping",
    "Run": "ddp_accel.training",
    "RunRecord": "ddp_accel.task",
    "ShardManifest": "ddp_accel.streaming",
    "ShardReader": "ddp_accel.streaming",
    "SparseAdamW": "ddp_accel.optim",
    "StopSignals": "ddp_accel.stopping",
    "Task": "ddp_accel.task",
    "TrainConfig": "ddp_accel.config",
    "UserError": "ddp_accel.errors",
    "WindowShuffle": "ddp_accel.streaming",
    "add_training_args": "ddp_accel.config",
    "build_accelerator": "ddp_accel.runtime",
    "check_memory": "ddp_accel.runtime",
    "check_trained_with": "ddp_accel.evaluation",
    "classification_metrics": "ddp_accel.metrics",
    "classification_names": "ddp_accel.metrics",
    "classification_values": "ddp_accel.metrics",
    "convert_sync_batchnorm": "ddp_accel.sync_bn",
    "evaluate": "ddp_accel.evaluation",
    "fit": "ddp_accel.training",
    "launched": "ddp_accel.notebook",
    "load_saved_weights": "ddp_accel.evaluation",
    "load_weights_file": "ddp_accel.evaluation",
    "make_accelerator": "ddp_accel.runtime",
    "make_identity": "ddp_accel.identity",
    "make_optimizer": "ddp_accel.optim",
    "print_banner": "ddp_accel.runtime",
    "process_rank": "ddp_accel.elastic",
    "run_main": "ddp_accel.endings",
    "write_json": "ddp_accel.files",
}

__all__ = [
    "ArgumentParser",
    "Callback",
    "Optimizers",
    "Preempted",
    "Run",
    "RunRecord",
    "ShardManifest",
    "ShardReader",
    "SparseAdamW",
    "StopSignals",
    "Task",
    "TrainConfig",
    "UserError",
    "WindowShuffle",
    "add_training_args",
    "build_accelerator",
    "check_memory",
    "check_trained_with",
    "classification_metrics",
    "classification_names",
    "classification_values",
    "cli",
    "convert_sync_batchnorm",
    "evaluate",
    "fit",
    "launched",
    "load_saved_weights",
    "load_weights_file",
    "make_accelerator",
    "make_identity",
    "make_optimizer",
    "print_banner",
    "process_rank",
    "run_main",
    "write_json",
]


def __getattr__(name: str) -> Any:
    if name == "cli":
        return importlib.import_module("ddp_accel.cli")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddp_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once
    return value
