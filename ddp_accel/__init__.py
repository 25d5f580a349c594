"""ddp-accel: classic PyTorch DDP recipes as Hugging Face Accelerate training scripts."""

from ddp_accel.cli import ArgumentParser
from ddp_accel.config import TrainConfig, add_training_args
from ddp_accel.errors import UserError
from ddp_accel.runtime import build_accelerator, launched, print_banner, run_main
from ddp_accel.stopping import StopSignals
from ddp_accel.training import evaluate, fit

__all__ = [
    "ArgumentParser",
    "StopSignals",
    "TrainConfig",
    "UserError",
    "add_training_args",
    "build_accelerator",
    "evaluate",
    "fit",
    "launched",
    "print_banner",
    "run_main",
]
