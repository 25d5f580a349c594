"""ddp-accel: classic PyTorch DDP recipes as Hugging Face Accelerate training scripts.

The front door: scripts import from here (and from the domain packages `ddp_accel.vision`, `ddp_accel.text`).
"""

from ddp_accel import cli
from ddp_accel.callbacks import Callback
from ddp_accel.cli import ArgumentParser
from ddp_accel.config import TrainConfig, add_training_args
from ddp_accel.errors import UserError
from ddp_accel.evaluation import check_trained_with, evaluate, load_saved_weights, load_weights_file
from ddp_accel.files import write_json
from ddp_accel.identity import make_identity
from ddp_accel.metrics import classification_metrics, classification_names, classification_values
from ddp_accel.optim import Optimizers, SparseAdamW, make_optimizer
from ddp_accel.runtime import (
    build_accelerator,
    check_memory,
    launched,
    make_accelerator,
    print_banner,
    process_rank,
    run_main,
)
from ddp_accel.stopping import Preempted, StopSignals
from ddp_accel.sync_bn import convert_sync_batchnorm
from ddp_accel.task import RunRecord, Task
from ddp_accel.training import TrainingRun, fit

__all__ = [
    "ArgumentParser",
    "Callback",
    "Optimizers",
    "Preempted",
    "RunRecord",
    "SparseAdamW",
    "StopSignals",
    "Task",
    "TrainConfig",
    "TrainingRun",
    "UserError",
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
