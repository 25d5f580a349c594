"""The options every training script shares, defined once: the `TrainConfig` dataclass drives the command line
(`add_training_args`), and a parsed command line gives the dataclass back (`TrainConfig.from_args`). Pure data: the
Accelerator is made from it by `ddp_accel.make_accelerator`."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from ddp_accel.errors import UserError


# --- the values an option takes: argparse types, so that every option is checked before anything runs ---
def step_range(text: str) -> tuple[int, int]:
    """START:END with 0 <= START < END (--profile-steps)."""
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END (e.g. 10:15), got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"needs 0 <= START < END, got {text}")
    return start, end


def checkpointing_steps(value: str) -> int | str:
    if value in ("epoch", "auto"):
        return value
    try:
        steps = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps, 'epoch' or 'auto', got {value!r}") from None
    if steps <= 0:
        raise argparse.ArgumentTypeError("must be a positive number of steps")
    return steps


def number(
    cast: type = float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> Callable[[str], Any]:
    """An argparse type: an int or a finite float within [low, high] (open ends where asked). Every numeric
    option of every script is checked by one of these, before anything runs."""

    def convert(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if cast is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if low is not None and (value < low or low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low}, got {text}")
        if high is not None and (value > high or high_open and value == high):
            raise argparse.ArgumentTypeError(f"must be {'<' if high_open else '<='} {high}, got {text}")
        return value

    convert.__name__ = cast.__name__
    return convert


positive_int = number(int, low=1)
nonnegative_int = number(int, low=0)
positive = number(float, low=0, low_open=True)
nonnegative = number(float, low=0)
fraction = number(float, low=0, high=1, low_open=True, high_open=True)  # strictly between 0 and 1
probability = number(float, low=0, high=1, high_open=True)  # dropout, label smoothing: 0 allowed, 1 not
chance = number(float, low=0, high=1)  # how often something happens: never (0) to always (1)


def fold(text: str) -> str:
    """`I/K`: the I-th of K parts (1 <= I <= K, K >= 2), e.g. `2/5`; kept as text (a run's identity is JSON)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/K (e.g. 2/5: the second of 5 parts)") from None
    if count < 2 or not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"{text!r}: I/K needs K of at least 2 and I from 1 to K")
    return f"{index}/{count}"


seed_value = number(int, low=0, high=2**32 - 1)  # numpy's seed range (accelerate's set_seed seeds numpy too)
timeout_seconds = number(int, low=1, high=365 * 24 * 3600)  # torch's timedelta for collectives overflows far above


DURATION = re.compile(r"(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m(?:in)?)?(?:(?P<s>\d+(?:\.\d+)?)s)?")
LONGEST = 365 * 24 * 3600.0


def duration(text: str) -> float:
    """Seconds of a duration: `900` (seconds), `900s`, `15m`, `1h30m`, `2.5h` (--time-budget). Every number after
    the first needs its unit: `1h30` is refused, not read as 1 h 0 min 30 s."""
    plain = text.strip().lower()
    if plain.replace(".", "", 1).isdigit():
        total = float(plain)
    else:
        match = DURATION.fullmatch(plain)
        if not plain or match is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 15m, 1h30m, 900s)")
        hours, minutes, seconds = (float(match[unit] or 0) for unit in "hms")
        total = hours * 3600 + minutes * 60 + seconds
    if not 0 < total <= LONGEST:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be above 0 and at most a year")
    return total


def format_duration(seconds: float) -> str:
    """`14 min 5 s`, `1 h 2 min`, `45 s`: what a user reads in a banner."""
    if seconds < 9.95:
        return f"{seconds:.2f} s" if seconds < 0.995 else f"{seconds:.1f} s"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min" + (f" {seconds} s" if seconds else "")
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


OPTIMIZERS = ("sgd", "adamw", "adam", "rmsprop")
# options a resume may change (the weights and the optimizer's state fit them): said in one line when they do.
# What shapes the model, the data or the optimizer's state is the run's identity instead, and refused.
CHANGEABLE_AT_RESUME = (
    *("lr", "lr_schedule", "warmup_epochs", "min_lr", "lr_gamma", "lr_step_epochs", "lr_milestones"),
    *("plateau_patience", "momentum", "nesterov", "weight_decay", "betas", "max_grad_norm", "ema_decay"),
    *("ema_warmup", "early_stopping_patience", "early_stopping_min_delta"),
    *("ddp_comm_hook", "powersgd_rank", "powersgd_start_step", "exact_micro_batch", "skip_bad_samples"),
)
LR_SCHEDULES = ("constant", "step", "multistep", "cosine", "onecycle", "plateau", "linear")
ENDING_AT_MIN_LR = ("cosine", "onecycle", "linear")  # the schedules --min-lr shapes

# what an unset --powersgd-* means (its one declaration): recorded as PowerSGD runs with it
POWERSGD_DEFAULTS = {"powersgd_rank": 1, "powersgd_start_step": 1000}


def option(default: Any, help: str | None = None, **argparse_options: Any) -> Any:
    """A TrainConfig field that is also a command-line option (`--field-name`, also `--field_name`)."""
    return field(default=default, metadata={"help": help, **argparse_options})


@dataclass
class TrainConfig:
    output_dir: str = option("outputs/run", "where checkpoints, metrics and the model go")
    epochs: int = option(1, "passes over the training data", type=positive_int)
    max_steps: int | None = option(None, "stop after this many optimizer steps", type=positive_int)
    time_budget: float | None = option(
        None,
        "the whole command's wall-clock time (e.g. 15m, 1h30m): as many epochs as fit in it, at most --epochs, "
        "chosen at the start from a few timed training and evaluation batches; a resume keeps the choice",
        type=duration,
        metavar="DURATION",
    )
    batch_size: int = option(32, "per process; global = this x processes", type=positive_int)
    lr: float = option(1e-3, "peak learning rate", type=positive)
    seed: int = option(0, "model initialisation and data order", type=seed_value)
    gradient_accumulation_steps: int = option(1, type=positive_int)
    optimizer: str | None = option(
        None,
        "sgd (with --momentum, --nesterov), adamw (decoupled weight decay, --betas), adam (--betas), rmsprop "
        "(--momentum). Default: the script's own",
        choices=list(OPTIMIZERS),
    )
    momentum: float = option(0.9, "sgd, rmsprop: momentum (0: none)", type=probability)
    nesterov: bool = option(False, "sgd: Nesterov's momentum")
    weight_decay: float | None = option(
        None, "weight decay (adamw: decoupled; the others: an L2 term). Default: the script's own", type=nonnegative
    )
    betas: tuple[float, float] = option(
        (0.9, 0.999), "adam, adamw: the moments' decay rates", type=probability, nargs=2, metavar=("B1", "B2")
    )
    lr_schedule: str | None = option(
        None,
        "the learning-rate schedule, after a linear warm-up of --warmup-epochs: constant; step (x --lr-gamma every "
        "--lr-step-epochs); multistep (x --lr-gamma at each of --lr-milestones); cosine (down to --min-lr); "
        "onecycle (up from --lr/25, then cosine down); plateau (x --lr-gamma after --plateau-patience evaluations "
        "without improvement of --best-metric); linear (down to --min-lr in a straight line; its warm-up in whole "
        "steps). Default: the script's own",
        choices=LR_SCHEDULES,
    )
    warmup_epochs: float = option(0.0, "--lr-schedule: linear warm-up from 0 over this many epochs", type=nonnegative)
    min_lr: float = option(0.0, "cosine, onecycle, linear: the learning rate at the end", type=nonnegative)
    lr_gamma: float = option(
        0.1, "step, multistep, plateau: the factor of each decay", type=number(float, low=0, high=1, low_open=True)
    )
    lr_step_epochs: int = option(30, "step: a decay every this many epochs", type=positive_int)
    lr_milestones: list[int] | None = option(None, "multistep: the epochs of the decays", type=positive_int, nargs="+")
    plateau_patience: int = option(2, "plateau: evaluations without improvement before a decay", type=positive_int)
    skip_bad_samples: int = option(
        0,
        "at most N training samples that cannot be read (an unreadable image, a sample without its label, a row "
        "that is not JSON): each said once, replaced by the next readable sample, listed in "
        "OUTPUT_DIR/bad_samples.jsonl and counted at the end; one more ends the run. Default 0: the first is an error",
        type=nonnegative_int,
        metavar="N",
    )
    auto_batch_size: bool = option(
        False,
        "per process, the largest divisor of --batch-size that fits in memory (tried before training); the global "
        "batch is kept by accumulating more",
    )
    max_grad_norm: float | None = option(None, "clip gradients to this norm", type=positive)
    checkpointing_steps: int | str | None = option(
        None,
        "N, 'epoch', or 'auto': the interval that loses the least time to failures and saves, from a save's "
        "measured stall and the time between interruptions (--mtbf)",
        type=checkpointing_steps,
    )
    mtbf: float | None = option(
        None,
        "--checkpointing-steps auto: the mean time between interruptions of a job like this one (e.g. 12h; "
        "default 24h), updated with this launch's restarts",
        type=duration,
        metavar="DURATION",
    )
    checkpoint_limit: int | None = option(None, "keep only the newest K", type=positive_int)
    async_checkpoint: bool = option(
        False,
        "a checkpoint is copied into memory and written by a background thread while training goes on; it becomes "
        "latest once complete; a stop waits for it, then saves its own step",
    )
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
        None,
        "default: what the accelerate config says; auto: bf16 where the device computes it natively, else no",
        choices=["no", "fp16", "bf16", "auto"],
    )
    ema_decay: float | None = option(
        None,
        "keep an exponential moving average of the weights (e.g. 0.999): evaluated beside them (ema_* metrics), "
        "saved in checkpoints, committed as model_ema.safetensors",
        type=number(float, low=0, high=1, low_open=True, high_open=True),
        metavar="DECAY",
    )
    ema_warmup: bool = option(False, "EMA decay min(DECAY, (1 + t) / (10 + t)) at update t: early weights fade fast")
    best_metric: str | None = option(
        None,
        "the metric model_best.safetensors is chosen by (e.g. ema_top1, eval_loss: lower is better for a *loss); "
        "default: the script's",
        metavar="NAME",
    )
    early_stopping_patience: int | None = option(
        None,
        "end training after this many evaluations in a row without an improvement of --best-metric",
        type=positive_int,
        metavar="N",
    )
    early_stopping_min_delta: float = option(
        0.0, "the least change of --best-metric that counts as an improvement", type=nonnegative, metavar="D"
    )
    profile_steps: tuple[int, int] | None = option(
        None,
        "record optimizer steps START+1..END with torch.profiler on the main process: a trace in OUTPUT_DIR/profile/ "
        "and the top operators printed",
        type=step_range,
        metavar="START:END",
    )
    compile: str | None = option(
        None,
        "torch.compile the model in place (nn.Module.compile: the weights keep their names); MODE: default, "
        "reduce-overhead, max-autotune, max-autotune-no-cudagraphs",
        nargs="?",
        const="default",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        metavar="MODE",
    )
    compile_backend: str = option(
        "inductor", "torch.compile's backend (eager, aot_eager: no C++ compiler needed; for checks)"
    )
    ddp_comm_hook: str = option(
        "none",
        "how DDP all-reduces the gradients: fp16/bf16 send half the bytes; powersgd sends low-rank factors with "
        "error feedback (kept in checkpoints). Several processes, not under FSDP",
        choices=["none", "fp16", "bf16", "powersgd"],
    )
    exact_micro_batch: int | None = option(
        None,
        "add the gradients in one order at any number of processes: each process's batch computed in pieces of M "
        "samples, every piece's gradient added in the global batch's order along the ranks, so that a run "
        "resumed on another number of processes (the same global batch) stays bitwise equal. Slower: a forward "
        "and backward per M samples; no BatchNorm running statistics, FSDP, fp16 or comm hook",
        type=positive_int,
        metavar="M",
    )
    powersgd_rank: int | None = option(None, "PowerSGD's matrix rank (default 1)", type=positive_int, metavar="R")
    powersgd_start_step: int | None = option(
        None,
        "PowerSGD compresses from the step after this one (default 1000; at least 2)",
        type=number(int, low=2),
        metavar="N",
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

    # each component's section (SECTIONS): what it is built from
    @property
    def run(self) -> RunOptions:
        return RunOptions.of(self)

    @property
    def data(self) -> DataOptions:
        return DataOptions.of(self)

    @property
    def length(self) -> LengthOptions:
        return LengthOptions.of(self)

    @property
    def optimization(self) -> OptimizerOptions:
        return OptimizerOptions.of(self)

    @property
    def schedule(self) -> ScheduleOptions:
        return ScheduleOptions.of(self)

    @property
    def checkpointing(self) -> CheckpointOptions:
        return CheckpointOptions.of(self)

    @property
    def evaluation(self) -> EvaluationOptions:
        return EvaluationOptions.of(self)

    @property
    def averaging(self) -> AveragingOptions:
        return AveragingOptions.of(self)

    @property
    def tracking(self) -> TrackingOptions:
        return TrackingOptions.of(self)

    @property
    def compilation(self) -> CompileOptions:
        return CompileOptions.of(self)

    @property
    def communication(self) -> CommunicationOptions:
        return CommunicationOptions.of(self)

    @property
    def watchdog(self) -> WatchdogOptions:
        return WatchdogOptions.of(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> TrainConfig:
        """The shared options of a parsed command line; every argument is kept for args.json and trackers."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, "hparams": dict(vars(args)), **overrides})

    def check(self) -> None:
        """Every section's own check (what the script gives fit is checked by fit: `check_evaluation`)."""
        for check in SECTION_CHECKS:
            check(self)

    def changeable_options(self) -> dict[str, Any]:
        """This run's values of CHANGEABLE_AT_RESUME, as JSON keeps them (tuples as lists)."""
        values = {key: getattr(self, key) for key in CHANGEABLE_AT_RESUME}
        for key, default in POWERSGD_DEFAULTS.items():  # PowerSGD's values as it runs with them, or none at all
            values[key] = (values[key] or default) if self.ddp_comm_hook == "powersgd" else None
        return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}

    def hyperparameters(self) -> dict[str, Any]:
        if self.hparams is not None:
            return self.hparams
        return {key: getattr(self, key) for key in (f.name for f in fields(self)) if key != "hparams"}


# --- sections: each component of a run is built from its own part of the options, never from the whole ---
SectionT = TypeVar("SectionT", bound="Section")


@dataclass(frozen=True)
class Section:
    """One component's part of the options: the TrainConfig fields it reads, by the same names. The command line
    stays flat (`--checkpoint-limit`); `config.checkpointing` is the section the checkpoints are built from."""

    @classmethod
    def of(cls: type[SectionT], config: TrainConfig) -> SectionT:
        return cls(**{name.name: getattr(config, name.name) for name in fields(cls)})


@dataclass(frozen=True)
class RunOptions(Section):
    """The run's folder, its precision and its process group's timeout: what the Accelerator is built from."""

    output_dir: str
    mixed_precision: str | None
    timeout_s: int


@dataclass(frozen=True)
class DataOptions(Section):
    """The training data's batches and order."""

    batch_size: int
    gradient_accumulation_steps: int
    auto_batch_size: bool
    seed: int
    skip_bad_samples: int


@dataclass(frozen=True)
class LengthOptions(Section):
    """How long the run trains: epochs, a step limit, or a time budget."""

    epochs: int
    max_steps: int | None
    time_budget: float | None


@dataclass(frozen=True)
class OptimizerOptions(Section):
    """The shared optimizer (make_optimizer) and the gradient's clip."""

    optimizer: str | None
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float | None
    betas: tuple[float, float]
    max_grad_norm: float | None


@dataclass(frozen=True)
class ScheduleOptions(Section):
    """The shared learning-rate schedule (`lr` is its peak, `epochs` its length for the checks)."""

    lr: float
    epochs: int
    lr_schedule: str | None
    warmup_epochs: float
    min_lr: float
    lr_gamma: float
    lr_step_epochs: int
    lr_milestones: list[int] | None
    plateau_patience: int


@dataclass(frozen=True)
class CheckpointOptions(Section):
    """When checkpoints are saved, how many are kept, how they are written, and which one a run resumes."""

    checkpointing_steps: int | str | None
    mtbf: float | None
    checkpoint_limit: int | None
    async_checkpoint: bool
    resume_from_checkpoint: str | None
    overwrite_output_dir: bool


@dataclass(frozen=True)
class EvaluationOptions(Section):
    """When the run evaluates, and what watches the evaluations (the best model, early stopping)."""

    eval_steps: int | None
    eval_every_epochs: int
    best_metric: str | None
    early_stopping_patience: int | None
    early_stopping_min_delta: float


@dataclass(frozen=True)
class AveragingOptions(Section):
    """The weights' exponential moving average."""

    ema_decay: float | None
    ema_warmup: bool


@dataclass(frozen=True)
class TrackingOptions(Section):
    """What the run logs, where, and the profiler's window."""

    log_steps: int
    with_tracking: bool
    report_to: str
    profile_steps: tuple[int, int] | None


@dataclass(frozen=True)
class CompileOptions(Section):
    compile: str | None
    compile_backend: str


@dataclass(frozen=True)
class CommunicationOptions(Section):
    """How DDP all-reduces the gradients."""

    ddp_comm_hook: str
    powersgd_rank: int | None
    powersgd_start_step: int | None
    exact_micro_batch: int | None


@dataclass(frozen=True)
class WatchdogOptions(Section):
    """The hang watchdog's bound on a step without progress."""

    hang_timeout_s: float | None


SECTIONS: dict[str, type[Section]] = {
    "run": RunOptions,
    "data": DataOptions,
    "length": LengthOptions,
    "optimization": OptimizerOptions,
    "schedule": ScheduleOptions,
    "checkpointing": CheckpointOptions,
    "evaluation": EvaluationOptions,
    "averaging": AveragingOptions,
    "tracking": TrackingOptions,
    "compilation": CompileOptions,
    "communication": CommunicationOptions,
    "watchdog": WatchdogOptions,
}


# --- each section of the options checks itself, in one place: an option given that nothing reads, or that
# contradicts another, is one line, before anything runs ---
def check_optimization(options: Any) -> None:
    """--optimizer, --momentum, --nesterov, --betas (a TrainConfig or a parsed command line). Without --optimizer
    the script builds its own optimizer and reads none of them."""
    if options.optimizer is None:
        return
    check_momentum(options)
    if tuple(options.betas) != (0.9, 0.999) and options.optimizer not in ("adam", "adamw"):
        raise UserError(f"--betas are Adam's and AdamW's: --optimizer {options.optimizer} has none")


def check_momentum(options: Any) -> None:
    """--nesterov needs SGD's momentum (make_optimizer checks it too: a script may build from its own namespace)."""
    if options.nesterov and (options.optimizer != "sgd" or options.momentum == 0):
        raise UserError(
            f"--nesterov is SGD's, with momentum: it needs --optimizer sgd and --momentum above 0 (here "
            f"--optimizer {options.optimizer}, --momentum {options.momentum:g})"
        )


def check_averaging(config: TrainConfig) -> None:
    """--ema-decay, --ema-warmup."""
    if config.ema_warmup and not config.ema_decay:
        raise UserError("--ema-warmup shapes the average of --ema-decay: add --ema-decay (e.g. 0.999)")


def check_compilation(config: TrainConfig) -> None:
    """--compile, --compile-backend."""
    if config.compile_backend != "inductor" and not config.compile:
        raise UserError(f"--compile-backend {config.compile_backend} is --compile's: add --compile")
    if config.compile:
        import torch.compiler

        if config.compile_backend not in torch.compiler.list_backends(exclude_tags=()):
            names = ", ".join(torch.compiler.list_backends())
            raise UserError(
                f"--compile-backend {config.compile_backend} is not one of torch's: {names}, eager, aot_eager"
            )


def check_schedule(config: TrainConfig) -> None:
    """--lr-schedule and the options of each schedule, against --lr and --epochs."""
    schedule = config.lr_schedule
    if config.warmup_epochs and not schedule:
        raise UserError("--warmup-epochs warms up the shared --lr-schedule: give one (e.g. cosine)")
    if config.min_lr and schedule not in ENDING_AT_MIN_LR:
        raise UserError(
            f"--min-lr is where cosine, onecycle and linear end: not used by --lr-schedule {schedule or '(none)'}"
        )
    if config.lr_milestones and schedule != "multistep":
        raise UserError(f"--lr-milestones are multistep's: not used by --lr-schedule {schedule or '(none)'}")
    check_milestones(config)
    if schedule and config.warmup_epochs >= config.epochs:
        raise UserError(
            f"--warmup-epochs {config.warmup_epochs:g} lasts all --epochs {config.epochs}: --lr is never reached"
        )
    if schedule == "multistep" and not config.lr_milestones:
        raise UserError("--lr-schedule multistep needs --lr-milestones (epochs, e.g. 30 60 80)")
    if config.min_lr >= config.lr and schedule in ENDING_AT_MIN_LR:
        raise UserError(f"--min-lr {config.min_lr:g} must be below --lr {config.lr:g}")


def check_milestones(config: TrainConfig) -> None:
    milestones = config.lr_milestones or []
    if any(later <= earlier for earlier, later in zip(milestones, milestones[1:], strict=False)):
        raise UserError(f"--lr-milestones {' '.join(map(str, milestones))}: give them in increasing order")
    if milestones and milestones[-1] >= config.epochs:  # (a shorter --max-steps is a choice: not checked)
        raise UserError(
            f"--lr-milestones {' '.join(map(str, milestones))}: a decay at or past --epochs {config.epochs} never "
            "happens"
        )


def check_evaluation(
    config: TrainConfig, best_metric: str | None, evaluated: bool, metric_names: tuple[str, ...] = ()
) -> None:
    """What watches an evaluation (--best-metric, --early-stopping-patience, the plateau schedule), against what
    the script gives fit: an evaluation, its metric (`best_metric`: --best-metric, else the script's) and the
    names of what it reports (`metric_names`, without `eval_`; unknown when empty)."""
    if config.lr_schedule == "plateau" and not (best_metric and evaluated):
        raise UserError("--lr-schedule plateau watches an evaluation metric: an eval loader and --best-metric")
    if config.early_stopping_patience and (not evaluated or not best_metric):
        raise UserError(
            "--early-stopping-patience needs an evaluation to watch: an eval loader and a metric (--best-metric, "
            "e.g. eval_loss)"
        )
    if config.best_metric and not evaluated:  # (a script's own default metric waits for its evaluation silently)
        raise UserError(
            f"--best-metric {config.best_metric} picks model_best.safetensors by an evaluation: this run has none "
            "(no validation data); drop it, or keep a validation part"
        )
    if best_metric and best_metric.startswith("ema_") and not config.ema_decay:
        raise UserError(f"--best-metric {best_metric} is a metric of the weights' average: add --ema-decay")
    reported = [f"{prefix}_{name}" for prefix in ("eval", "ema")[: 1 + bool(config.ema_decay)] for name in metric_names]
    if best_metric and evaluated and reported and best_metric not in reported:
        raise UserError(f"--best-metric {best_metric} is not a metric of this run's evaluation: {', '.join(reported)}")


def check_communication(config: TrainConfig) -> None:
    """--powersgd-* belong to --ddp-comm-hook powersgd; --exact-micro-batch cuts --batch-size into whole pieces."""
    given = [name for name in ("powersgd_rank", "powersgd_start_step") if getattr(config, name) is not None]
    if given and config.ddp_comm_hook != "powersgd":
        options = " and ".join("--" + name.replace("_", "-") for name in given)
        raise UserError(f"{options}: only with --ddp-comm-hook powersgd")
    exact = config.exact_micro_batch
    if exact and config.ddp_comm_hook != "none":
        raise UserError(f"--exact-micro-batch {exact} adds the gradients itself: not with --ddp-comm-hook")
    if exact and config.auto_batch_size:
        raise UserError(f"--exact-micro-batch {exact} bounds a forward's memory itself: drop --auto-batch-size")
    if exact and config.batch_size % exact:
        raise UserError(
            f"--exact-micro-batch {exact}: --batch-size {config.batch_size} is not a whole number of pieces of {exact}"
        )


def check_strategy(
    config: TrainConfig, sharded: bool, deepspeed: bool = False, fsdp_version: int | None = None
) -> None:
    """Options that need whole weights on every rank, under a strategy that shards them (FSDP, DeepSpeed), and
    asynchronous checkpoints where they cannot be written as a synchronous save would."""
    if config.ema_decay and sharded:
        raise UserError("--ema-decay averages whole weights on every rank: not with FSDP or DeepSpeed shards")
    if config.async_checkpoint and deepspeed:
        raise UserError("--async-checkpoint: DeepSpeed writes its own checkpoints; drop the option")
    if config.async_checkpoint and fsdp_version == 1:
        raise UserError("--async-checkpoint under FSDP needs fsdp_version: 2 in the accelerate config; drop the option")


SECTION_CHECKS: tuple[Callable[[Any], None], ...] = (
    check_optimization,
    check_averaging,
    check_compilation,
    check_schedule,
    check_communication,
)


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
