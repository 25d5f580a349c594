"""The command line every script shares: `ArgumentParser` (one `error:` line under a launcher, "did you mean").

Options are spelled with dashes (`--output-dir`, pytorch/examples style) and also
accepted with underscores (`--output_dir`, Hugging Face examples style).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ddp_accel.config import (
    chance,
    checkpointing_steps,
    duration,
    fold,
    format_duration,
    fraction,
    nonnegative,
    nonnegative_int,
    number,
    positive,
    positive_int,
    probability,
    seed_value,
    step_range,
    timeout_seconds,
)
from ddp_accel.elastic import process_rank, report_to_launcher, stop_restarts, wait_for_a_stop_signal
from ddp_accel.launch_environments import Outcome, record_outcome

# the value types of every option live with the options (ddp_accel.config); scripts reach them as cli.positive_int
__all__ = [
    "ArgumentParser",
    "HelpFormatter",
    "chance",
    "checkpointing_steps",
    "duration",
    "fold",
    "format_duration",
    "fraction",
    "nonnegative",
    "nonnegative_int",
    "number",
    "positive",
    "positive_int",
    "probability",
    "seed_value",
    "step_range",
    "timeout_seconds",
]


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
        record_outcome(Outcome("user_error", 2, f"error: {message}"))
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
