"""Command-line options shared by every script.

Options are spelled with dashes (`--output-dir`, pytorch/examples style) and also
accepted with underscores (`--output_dir`, Hugging Face examples style).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import time


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None (the help text then says what happens)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that accepts `--some_option` wherever `--some-option` is defined, and suggests the closest
    option for a mistyped one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            known = [opt for action in self._actions for opt in action.option_strings if opt.startswith("--")]
            for unknown in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(unknown.split("=")[0].replace("_", "-"), known, n=1, cutoff=0.7)
                if close:
                    message += f" (did you mean {close[0]}?)"
                    break
        # Under a launcher every process parses the same arguments: one of them says it, and torch elastic's
        # failure report shows the message instead of 'To enable traceback see ...'
        from ddp_accel.runtime import report_to_launcher

        report_to_launcher(f"error: {message}")
        if os.environ.get("RANK", "0") != "0":
            # the launcher stops every process once one has ended: let rank 0 end first, having printed
            time.sleep(10)
            self.exit(2)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        known = {opt for action in self._actions for opt in action.option_strings}
        return super().parse_known_args([self._dashed(arg, known) for arg in args], namespace)

    @staticmethod
    def _dashed(arg: str, known: set[str]) -> str:
        if not arg.startswith("--") or "_" not in arg:
            return arg
        name, sep, value = arg.partition("=")
        dashed = "--" + name[2:].replace("_", "-")
        return dashed + sep + value if dashed in known and name not in known else arg


def checkpointing_steps(value: str) -> int | str:
    if value == "epoch":
        return value
    try:
        steps = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps or 'epoch', got {value!r}") from None
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
):
    """An argparse type: an int or a finite float within [low, high] (open ends where asked). Every numeric
    option of every script is checked by one of these, before anything runs."""

    def convert(text: str):
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


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every training script shares. Scripts change defaults with `parser.set_defaults`."""
    group = parser.add_argument_group("training (shared by every ddp_accel script)")
    group.add_argument("--output-dir", default="outputs/run", help="where checkpoints, metrics and the model go")
    # the legacy `python -m torch.distributed.launch` passes --local-rank=N; Accelerate reads LOCAL_RANK itself
    group.add_argument("--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    group.add_argument("--epochs", type=positive_int, default=1, help="passes over the training data")
    group.add_argument("--max-steps", type=positive_int, default=None, help="stop after this many optimizer steps")
    group.add_argument("--batch-size", type=positive_int, default=32, help="per process; global = this x processes")
    group.add_argument("--lr", type=positive, default=1e-3, help="peak learning rate")
    group.add_argument("--seed", type=nonnegative_int, default=0, help="model initialisation and data order")
    group.add_argument("--gradient-accumulation-steps", type=positive_int, default=1)
    group.add_argument("--max-grad-norm", type=positive, default=None, help="clip gradients to this norm")
    group.add_argument("--checkpointing-steps", type=checkpointing_steps, default=None, help="N or 'epoch'")
    group.add_argument("--checkpoint-limit", type=positive_int, default=None, help="keep only the newest K")
    group.add_argument(
        "--resume-from-checkpoint",
        default=None,
        metavar="PATH|latest",
        help="'latest' resumes the newest complete checkpoint in OUTPUT_DIR/checkpoints, or starts fresh if none",
    )
    group.add_argument(
        "--overwrite-output-dir",
        action="store_true",
        help="train over an --output-dir that holds a trained model or checkpoints (they are deleted)",
    )
    group.add_argument("--eval-steps", type=positive_int, default=None, help="also evaluate every N steps")
    group.add_argument("--log-steps", type=positive_int, default=20)
    group.add_argument("--with-tracking", action="store_true", help="log to TensorBoard in OUTPUT_DIR/tensorboard/")
    group.add_argument(
        "--report-to",
        choices=["tensorboard", "mlflow", "wandb", "all", "none"],
        default="none",
        help="experiment trackers (all: every installed one); one run across resumes and requeues",
    )
    group.add_argument(
        "--mixed-precision",
        choices=["no", "fp16", "bf16"],
        default=None,
        help="default: what the accelerate config says",
    )
    group.add_argument(
        "--timeout-s",
        type=positive_int,
        default=600,
        help="collective timeout: a dead or hung rank ends the job after this long",
    )
    return parser
