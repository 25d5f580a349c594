"""Command-line options shared by every script.

Options are spelled with dashes (`--output-dir`, pytorch/examples style) and also
accepted with underscores (`--output_dir`, Hugging Face examples style).
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ddp_accel.elastic import process_rank, report_to_launcher, stop_restarts, wait_for_a_stop_signal


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None (the help text then says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that accepts `--some_option` wherever `--some-option` is defined, and suggests the closest
    option for a mistyped one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = [opt for action in self._actions for opt in action.option_strings if opt.startswith("--")]
            for unknown in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(unknown.split("=")[0].replace("_", "-"), known, n=1, cutoff=0.7)
                if close:
                    message += f" (did you mean {close[0]}?)"
                    break
        # Under a launcher every process parses the same arguments: one of them says it, and torch elastic's
        # failure report shows the message instead of 'To enable traceback see ...'
        report_to_launcher(f"error: {message}")
        if process_rank() != 0:
            # the launcher stops every process once one has ended: let rank 0 end first, having printed (a stop
            # signal, the launcher ending this process, ends the wait)
            wait_for_a_stop_signal(10.0)
            self.exit(2)
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        stop_restarts()  # the same arguments fail the same way at every restart
        self.exit(2)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
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
