"""The accelerate config file a process runs under, read as `ddp-accel check-config` reads it, and its settings.

Two kinds of problem, told apart: a file that is wrong anywhere (a misspelt key Accelerate would drop without a
word, a value it cannot take: `UserError`), and one that is valid but not on this machine (a precision this
machine's devices lack, a package it lacks: `NotOnThisMachine`). A script started by `accelerate launch` reads the
file it was launched with (`launched_config`) and refuses both before its Accelerator, in one line.

An error Accelerate or torch raise later, while the Accelerator is built or the run is prepared, is told as one
line where a setting caused it (`settings_named`): the setting whose key or value the error names, with the fix.
An error that names no setting stays a traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import io
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_accel import launch_environments
from ddp_accel.errors import UserError

PRECISIONS = ("no", "fp16", "bf16", "fp8")
# what a distributed type or precision needs installed (accelerate launch fails deep inside otherwise)
REQUIRED_PACKAGES = {"DEEPSPEED": ("deepspeed",), "MEGATRON_LM": ("megatron",)}
FP8_BACKENDS = ("transformer_engine", "torchao", "msamp")
CHECK_HINT = "`ddp-accel check-config FILE` checks a file before a launch"


class NotOnThisMachine(UserError):
    """A config that is valid, but cannot run on this machine (its devices, its installed packages)."""


def has_accelerator() -> bool:
    """True when a GPU-like device is present. Does not initialise CUDA (safe before notebook_launcher)."""
    import torch

    if torch.cuda.is_available():
        return True
    backends = getattr(torch, "xpu", None), getattr(torch.backends, "mps", None)
    return any(backend is not None and backend.is_available() for backend in backends)


# --- reading a file, and what is wrong with it anywhere ---
def read_settings(path: str) -> dict[str, Any]:
    """The file's settings as written: a mapping, read as YAML (or JSON for a .json file)."""
    import yaml

    if Path(path).is_dir():
        raise UserError(f"{path} is a directory; pass a YAML file (the shipped ones are in accelerate_configs/)")
    if not Path(path).is_file():
        raise UserError(f"{path}: no such file; the shipped configs are in accelerate_configs/")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: not UTF-8 text (byte {error.start}); is it really a YAML file?") from None
    if not text.strip():
        raise UserError(f"{path} is empty; `accelerate config --config_file {path}` writes a valid file")
    try:
        raw = yaml.safe_load(text) if not path.endswith(".json") else json.loads(text)
    except (yaml.YAMLError, ValueError) as error:
        raise UserError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a mapping of settings (key: value), found {type(raw).__name__}")
    return raw


def check_settings(path: str, raw: dict[str, Any]) -> None:
    """What accelerate's loader would take but its launch refuses later, or not at all: whole numbers, the port's
    range, the precision's name, the keys of fsdp_config."""
    for key in ("num_processes", "num_machines", "machine_rank", "main_process_port"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise UserError(f"{path}: {key} must be a whole number, found {value!r}")
    port = raw.get("main_process_port")
    if port is not None and not 1 <= port <= 65535:
        raise UserError(f"{path}: main_process_port must be between 1 and 65535, found {port}")
    precision = raw.get("mixed_precision")
    if precision is not None and str(precision) not in PRECISIONS:
        raise UserError(f"{path}: mixed_precision must be one of {', '.join(PRECISIONS)}, found {precision!r}")
    check_fsdp_keys(path, raw)


def check_fsdp_keys(path: str, raw: dict[str, Any]) -> None:
    """Every key of fsdp_config one accelerate launch knows: it drops the others without a word."""
    if "fsdp_config" not in raw or str(raw.get("distributed_type", "")).split(".")[-1] != "FSDP":
        return
    settings = raw.get("fsdp_config") or {}
    if not isinstance(settings, dict):
        raise UserError(f"{path}: fsdp_config must be a mapping of fsdp_* settings")
    known = launch_keys("fsdp_")
    for key in settings:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f": did you mean {close[0]}?" if close else f" (accelerate launch knows {', '.join(sorted(known))})"
            raise UserError(f"{path}: fsdp_config has no key {key}{hint}")


@functools.cache
def launch_keys(prefix: str) -> list[str]:
    """The options of accelerate launch (its own parser) whose names start with `prefix`."""
    from accelerate.commands.launch import launch_command_parser

    return [key for key in vars(launch_command_parser().parse_args(["train.py"])) if key.startswith(prefix)]


def load_accelerate_config(path: str) -> Any:
    """accelerate's own loader, its errors as one line."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        return load_config_from_file(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; the shipped configs are in accelerate_configs/") from None
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "unknown keys" in message:
            keys = message[message.index("(") + 1 : message.index(")")]
            raise UserError(
                f"{path}: unknown keys {keys}; fix or remove them (`accelerate config` writes a valid file)"
            ) from None
        raise UserError(f"{path}: {message}") from None


def check_loaded(path: str, raw: dict[str, Any], config: Any) -> str:
    """The loaded config's topology; returns the distributed type's name."""
    for key in ("num_processes", "num_machines"):
        value = getattr(config, key, 1)
        if key == "num_processes" and key not in raw:  # accelerate's own "not set" (-1): its launch says so
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{path}: {key} must be a whole number >= 1, found {value!r}")
    if not 0 <= getattr(config, "machine_rank", 0) < config.num_machines:
        raise UserError(
            f"{path}: machine_rank must be between 0 and num_machines - 1 ({config.num_machines - 1}), "
            f"found {config.machine_rank!r}"
        )
    return str(config.distributed_type).split(".")[-1]


def check_anywhere(path: str) -> tuple[dict[str, Any], Any, str]:
    """Whatever is wrong with the file on any machine (UserError); returns its settings as written, as accelerate
    loads them, and its distributed type."""
    raw = read_settings(path)
    check_settings(path, raw)
    config = load_accelerate_config(path)
    return raw, config, check_loaded(path, raw, config)


# --- valid, but not on this machine ---
def check_this_machine(path: str, raw: dict[str, Any], kind: str, precision: str | None = None) -> None:
    """What this machine lacks for the file: a package its strategy or precision needs, a GPU for fp16.
    `precision`: the one the run uses where it overrides the file's (a launch option, the script's)."""
    for package in REQUIRED_PACKAGES.get(kind, ()):
        if importlib.util.find_spec(package) is None:
            raise NotOnThisMachine(
                f"{path}: distributed_type {kind} needs the {package} package, which is not installed here"
            )
    precision = precision or str(raw.get("mixed_precision", "no"))
    if precision == "fp8" and not any(importlib.util.find_spec(name) for name in FP8_BACKENDS):
        raise NotOnThisMachine(
            f"{path}: mixed_precision fp8 needs one of {', '.join(FP8_BACKENDS)} installed (and a GPU that has fp8); "
            "here use bf16 or no"
        )
    if precision == "fp16" and not has_accelerator():
        raise NotOnThisMachine(f"{path}: mixed_precision fp16 needs a GPU, and this machine has none: use bf16 or no")


# --- the file a launched process runs under ---
def launch_arguments(command: list[str]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The arguments of an `accelerate launch` command line, as its own parser reads them, and its defaults; None
    for another command (or one it cannot read)."""
    from accelerate.commands.launch import launch_command_parser

    if not launch_environments.is_accelerate_launch(command):
        return None
    start = next(
        (
            i + 1
            for i, part in enumerate(command)
            if part == "launch" or part.endswith(("accelerate-launch", ".launch"))
        ),
        None,
    )
    if start is None:
        return None
    parser = launch_command_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return vars(parser.parse_args(command[start:])), vars(parser.parse_args(["train.py"]))
    except SystemExit:
        return None


def file_accelerate_launch_reads(config_file: str | None, cpu: bool) -> str | None:
    """The config file `accelerate launch` reads: its --config_file, else Accelerate's default config file (what
    `accelerate config` writes) where there is one, as accelerate launch reads it: not under --cpu. None: none."""
    if config_file:
        return config_file
    from accelerate.commands.config.config_args import default_config_file

    return default_config_file if os.path.isfile(default_config_file) and not cpu else None


def launched_config(command: list[str] | None = None) -> str | None:
    """The config file of the `accelerate launch` that started this process (its parent): its --config_file,
    else Accelerate's default config file where there is one; None under any other launcher."""
    arguments = launch_arguments(launch_environments.parent_command() if command is None else command)
    if arguments is None:
        return None
    given = arguments[0].get("config_file")
    path = file_accelerate_launch_reads(given, bool(arguments[0].get("cpu")))
    if path is None or not given:
        return path
    if not os.path.isabs(path) and command is None:  # the launcher's own folder (the script may change its own)
        with contextlib.suppress(OSError):
            return os.path.join(os.readlink(f"/proc/{os.getppid()}/cwd"), path)
    return path


def check_launched_config(command: list[str] | None = None, precision: str | None = None) -> None:
    """A script started by `accelerate launch`: its config file refused as `ddp-accel check-config` refuses it
    (a UserError, said once per run), before anything else is built. `precision`: the run's own (the script's
    option, else what the launch passes on), over the file's."""
    path = launched_config(command)
    if path is not None:
        raw, _, kind = check_anywhere(path)
        check_this_machine(path, raw, kind, precision or os.environ.get("ACCELERATE_MIXED_PRECISION"))


# --- an error raised while the Accelerator is built or the run prepared, told by the setting that caused it ---
@dataclass(frozen=True)
class Setting:
    key: str  # as the file writes it (fsdp_config's keys with their section)
    value: str
    source: str  # the file, the launcher's command line, the environment

    @property
    def option(self) -> str:
        """Its name as accelerate launch's option (an ACCELERATE_ variable's and a section's key as such)."""
        name = self.key.split(".")[-1]
        return name.removeprefix("ACCELERATE_").lower() if self.source == "the environment" else name

    def named_by(self, message: str) -> bool:
        """Whether an error's message names this setting: its key, or one of its values (a word of its own)."""
        name = self.key.split(".")[-1]
        if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message):
            return True
        return any(
            informative(part) and re.search(rf"(?<![\w.]){re.escape(part)}(?![\w])", message)
            for part in self.value.split(",")
        )


UNINFORMATIVE = {"true", "false", "none", "null", "main", "local", "static", "all", "auto", "default", "no", "yes"}


def informative(value: str) -> bool:
    """A value that, found in a message, points at its setting: a name, not a number or a common word."""
    value = value.strip()
    return len(value) >= 3 and any(c.isalpha() for c in value) and value.lower() not in UNINFORMATIVE


# never the cause named for an error of the Accelerator's or its prepare: what only the launcher reads (the topology,
# the rendezvous: torch's own messages name "c10d" often), and the strategy's name
NEVER_BLAMED = {
    "config_file",
    "training_script",
    "training_script_args",
    "main_process_port",
    "main_process_ip",
    "compute_environment",
    "main_training_function",
    "rdzv_backend",
    "rdzv_conf",
    "same_network",
    "machine_rank",
    "num_machines",
    "num_processes",
    "gpu_ids",
    "enable_cpu_affinity",
    "debug",
    "max_restarts",
    "monitor_interval",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_name",
    "tpu_zone",
    "distributed_type",  # (its values, FSDP and MULTI_GPU, are named by many errors the strategy's code raises)
}


def settings_in(raw: Mapping[str, Any], source: str, prefix: str = "") -> list[Setting]:
    found = []
    for key, value in raw.items():
        if isinstance(value, Mapping):
            found += settings_in(value, source, f"{prefix}{key}.")
        elif value is not None and key not in NEVER_BLAMED:
            found.append(Setting(f"{prefix}{key}", str(value), source))
    return found


@functools.cache
def launch_settings() -> tuple[Setting, ...]:
    """The settings this process runs under: the launcher's command-line options, then its config file's; under
    another launcher, Accelerate's variables in the environment."""
    command = launch_environments.parent_command()
    arguments = launch_arguments(command)
    if arguments is None:
        prefixes = ("ACCELERATE_", "FSDP_")
        return tuple(Setting(k, v, "the environment") for k, v in os.environ.items() if k.startswith(prefixes))
    given, defaults = arguments
    found = [
        Setting(key, str(value), "accelerate launch's command line")
        for key, value in given.items()
        if key not in NEVER_BLAMED and value != defaults.get(key) and value not in (None, True, False)
    ]
    path = launched_config()  # (the parent's command: a relative path from the launcher's folder)
    if path is not None:
        with contextlib.suppress(UserError):
            found += settings_in(read_settings(path), path)
    return tuple(found)


Hints = Callable[[], Mapping[str, str]]


@contextlib.contextmanager
def settings_named(hints: Hints | None = None, settings: tuple[Setting, ...] | None = None) -> Iterator[None]:
    """An error Accelerate or torch raise inside, where a setting caused it, as a UserError naming the setting and
    the fix (`hints`: the fixes this run knows, by a setting's key without its section); any other error as it is."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        message = " ".join(str(error).split())
        for setting in launch_settings() if settings is None else settings:
            if setting.named_by(message):
                known = hints() if hints is not None else {}
                line = f"{setting.source}: {setting.key} {setting.value}: {message.rstrip('.')}; {fix(setting, known)}"
                raise UserError(line) from None
        raise


CHOICES = {
    "mixed_precision": "no, bf16, fp16 (with a GPU) or fp8 (with transformer_engine or torchao, on a GPU with fp8)"
}


def fix(setting: Setting, hints: Mapping[str, str]) -> str:
    """How to mend a setting: what this run knows of it, else the values it takes, else where it is."""
    name = setting.option
    if name in hints:
        return hints[name]
    in_file = setting.source.endswith((".yaml", ".yml", ".json"))
    where = f"change it in {setting.source}" + (f"; {CHECK_HINT}" if in_file else "")
    if name in CHOICES:
        return f"{name} takes {CHOICES[name]}: {where}"
    return where
