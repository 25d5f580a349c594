"""The options every training script shares, defined once: the `TrainConfig` dataclass drives the command line
(`add_training_args`), and a parsed command line gives the dataclass back (`TrainConfig.from_args`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from ddp_accel.cli import checkpointing_steps, nonnegative, positive, positive_int, seed_value, timeout_seconds
from ddp_accel.errors import UserError
from ddp_accel.runtime import build_accelerator
from ddp_accel.stopping import StopSignals
from ddp_accel.tracking import make_trackers, tracker_names


def option(default: Any, help: str | None = None, **argparse_options: Any) -> Any:
    """A TrainConfig field that is also a command-line option (`--field-name`, also `--field_name`)."""
    return field(default=default, metadata={"help": help, **argparse_options})


@dataclass
class TrainConfig:
    output_dir: str = option("outputs/run", "where checkpoints, metrics and the model go")
    epochs: int = option(1, "passes over the training data", type=positive_int)
    max_steps: int | None = option(None, "stop after this many optimizer steps", type=positive_int)
    batch_size: int = option(32, "per process; global = this x processes", type=positive_int)
    lr: float = option(1e-3, "peak learning rate", type=positive)
    seed: int = option(0, "model initialisation and data order", type=seed_value)
    gradient_accumulation_steps: int = option(1, type=positive_int)
    max_grad_norm: float | None = option(None, "clip gradients to this norm", type=positive)
    checkpointing_steps: int | str | None = option(None, "N or 'epoch'", type=checkpointing_steps)
    checkpoint_limit: int | None = option(None, "keep only the newest K", type=positive_int)
    resume_from_checkpoint: str | None = option(
        None,
        "'latest' resumes the newest complete checkpoint in OUTPUT_DIR/checkpoints, or starts fresh if none",
        metavar="PATH|latest",
    )
    overwrite_output_dir: bool = option(
        False, "train over an --output-dir that holds a trained model or checkpoints (they are deleted)"
    )
    eval_steps: int | None = option(None, "also evaluate every N steps", type=positive_int)
    eval_every_epochs: int = 1  # scripts set it (template: --eval-interval)
    log_steps: int = option(20, type=positive_int)
    with_tracking: bool = option(False, "log to TensorBoard in OUTPUT_DIR/tensorboard/")
    report_to: str = option(
        "none",
        "experiment trackers (all: every installed one); one run across resumes and requeues",
        choices=["tensorboard", "mlflow", "wandb", "all", "none"],
    )
    mixed_precision: str | None = option(
        None, "default: what the accelerate config says", choices=["no", "fp16", "bf16"]
    )
    timeout_s: int = option(
        600, "collective timeout: a dead or hung rank ends the job after this long", type=timeout_seconds
    )
    hang_timeout_s: float | None = option(
        None,
        "a rank with no training step or evaluation batch for this long writes its stacks to OUTPUT_DIR/hangs/ and "
        "exits with status 4 (a restart resumes); default: 20x the slowest step, at least 120 s. Before the first "
        "steps and during a checkpoint save: 30 min. 0: off",
        type=nonnegative,
    )
    hparams: dict[str, Any] | None = field(default=None, repr=False)  # what args.json records; default: this
    # the process's preemption state (run_main's, handed to the script's main); None: fit watches while it runs
    signals: StopSignals | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> TrainConfig:
        """The shared options of a parsed command line; every argument is kept for args.json and trackers."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, "hparams": dict(vars(args)), **overrides})

    def make_accelerator(self, check_output_dir: bool = True, **kwargs: Any) -> Accelerator:
        """The Accelerator, after checking --output-dir (pass check_output_dir=False when not training into it)."""
        if check_output_dir:
            self.check_output_dir()
        if self.signals is not None:  # a stop before training leaves its marker there
            self.signals.set_output_dir(Path(self.output_dir))
        # a missing tracker package: one line, before anything. The trackers start at the first log (TrackerLog)
        trackers = make_trackers(
            tracker_names(self.report_to, self.with_tracking),
            self.output_dir,
            resuming=self.resume_from_checkpoint is not None,
        )
        return build_accelerator(
            seed=self.seed,
            log_with=trackers or None,
            output_dir=self.output_dir,
            mixed_precision=self.mixed_precision,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            timeout_s=self.timeout_s,
            **kwargs,
        )

    def check_output_dir(self, has_checkpoints: bool | None = None) -> None:
        """The Hugging Face convention: a new run does not silently replace a trained model or the checkpoints of
        an unfinished run. A run that resumes from a checkpoint is not affected; `latest` without a checkpoint is a
        new run. Nothing is deleted here: `--overwrite-output-dir` deletes once every check has passed (fit)."""
        from ddp_accel.checkpoint import complete_checkpoints

        output_dir = Path(self.output_dir)
        if str(self.output_dir).strip() == "":
            raise UserError("--output-dir is empty; name a folder (it is created if missing)")
        if output_dir.exists() and not output_dir.is_dir():
            raise UserError(f"--output-dir {output_dir} is a file; pass a folder (it is created if missing)")
        if has_checkpoints is None:  # the early check (make_accelerator): `latest` is decided by fit, which can
            if self.resume_from_checkpoint == "latest":  # tell a complete run from one to refuse
                return
            has_checkpoints = bool(complete_checkpoints(output_dir / "checkpoints"))
        resuming = self.resume_from_checkpoint is not None and (
            self.resume_from_checkpoint != "latest" or has_checkpoints
        )
        if resuming or not output_dir.is_dir() or self.overwrite_output_dir:
            return
        held = (
            "a trained model (model.safetensors)"
            if (output_dir / "model.safetensors").exists()
            else "checkpoints of an unfinished run"
            if has_checkpoints
            else None
        )
        if held:
            raise UserError(
                f"--output-dir {output_dir} already holds {held}"
                + (" and no checkpoint to resume" if self.resume_from_checkpoint == "latest" else "")
                + "; continue it with --resume-from-checkpoint latest, replace it with --overwrite-output-dir, or "
                "pick another --output-dir"
            )

    def hyperparameters(self) -> dict[str, Any]:
        if self.hparams is not None:
            return self.hparams
        return {key: getattr(self, key) for key in (f.name for f in fields(self)) if key not in ("hparams", "signals")}


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every training script shares, from TrainConfig's fields. Scripts change defaults with
    `parser.set_defaults`."""
    group = parser.add_argument_group("training (shared by every ddp_accel script)")
    for config_field in fields(TrainConfig):
        if "help" not in config_field.metadata:
            continue
        options = dict(config_field.metadata)
        if config_field.default is False:
            options["action"] = "store_true"
        group.add_argument("--" + config_field.name.replace("_", "-"), default=config_field.default, **options)
    # the legacy `python -m torch.distributed.launch` passes --local-rank=N; Accelerate reads LOCAL_RANK itself
    group.add_argument("--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser
