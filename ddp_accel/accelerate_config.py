"""`ddp-accel check-config FILE` and `ddp-accel launch`'s check of its config: an accelerate YAML validated before
a launch, with one line for what is wrong (`accelerate launch` answers a bad config with a long traceback)."""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml
from accelerate.commands.config.config_args import load_config_from_file

from ddp_accel.errors import UserError
from ddp_accel.runtime import has_accelerator
from ddp_accel.sharding import cpu_fsdp_plugin, fsdp_plugin

PRECISIONS = ("no", "fp16", "bf16", "fp8")
# what a distributed type or precision needs installed (accelerate launch fails deep inside otherwise)
REQUIRED_PACKAGES = {"DEEPSPEED": ("deepspeed",), "MEGATRON_LM": ("megatron",)}
FP8_BACKENDS = ("transformer_engine", "torchao", "msamp")


def check_config(path: str) -> str:
    """Load `path` with accelerate's own loader and launch-argument validation, plus what accelerate launch would
    reject later (port range, precision, packages); return a one-line summary or raise UserError. Never a
    traceback."""
    raw = read_settings(path)
    check_settings(path, raw)
    config = load_accelerate_config(path)
    kind = check_loaded(path, raw, config)
    validate_like_accelerate_launch(path)
    summary = f"{path}: {kind}, {config.num_processes} process(es) on {config.num_machines} machine(s)"
    notes = check_fsdp(path, raw) if kind == "FSDP" else []
    if kind in ("MULTI_GPU", "FSDP") and not has_accelerator():
        summary += (
            "; no GPU here: ddp_accel scripts run it as MULTI_CPU/gloo"
            if kind == "MULTI_GPU"
            else "; no GPU here: ddp_accel scripts run it as FSDP2 on the CPU over gloo"
        )
    return "; ".join([summary, *notes])


def check_fsdp(path: str, raw: dict[str, Any]) -> list[str]:
    """An FSDP config as Accelerate reads it: every key of `fsdp_config` one accelerate launch knows, the plugin
    Accelerate builds from them (and, without a GPU, one ddp_accel runs), and a note for each key that changes
    nothing under this version (FSDP1's keys under fsdp_version 2: Accelerate drops them without a word)."""
    from accelerate.commands.launch import launch_command_parser

    settings = raw.get("fsdp_config") or {}
    if not isinstance(settings, dict):
        raise UserError(f"{path}: fsdp_config must be a mapping of fsdp_* settings")
    known = [key for key in vars(launch_command_parser().parse_args(["train.py"])) if key.startswith("fsdp_")]
    for key in settings:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f": did you mean {close[0]}?" if close else f" (accelerate launch knows {', '.join(sorted(known))})"
            raise UserError(f"{path}: fsdp_config has no key {key}{hint}")
    environment = launch_environment(path)
    build = fsdp_plugin if has_accelerator() else cpu_fsdp_plugin
    plugin = in_file(path, lambda: build(environment))
    notes = []
    for key in settings:  # left out, the launch gives its variable another value: the same plugin, it is ignored
        without = launch_environment(path, drop=key)
        changed = [name for name, value in environment.items() if name in without and without[name] != value]
        if changed and same_plugin(probe_plugin(without), plugin):
            notes.append(f"{key} changes nothing under fsdp_version {plugin.fsdp_version} (Accelerate ignores it)")
    return notes


def probe_plugin(environment: dict[str, str]) -> Any:
    """The plugin of a variant of the config (one key left out); None where that variant is not one at all."""
    try:
        return fsdp_plugin(environment)
    except UserError:
        return None


def in_file(path: str, build: Any) -> Any:
    """`build()`, its one-line refusal said of the file `path`."""
    try:
        return build()
    except UserError as error:
        raise UserError(f"{path}: {error}") from None


def same_plugin(one: Any, other: Any) -> bool:
    """Whether two FSDP plugins are the same settings (their functions' addresses aside)."""

    def settings(plugin: Any) -> dict[str, str]:
        return {name: re.sub(r" at 0x[0-9a-f]+", "", repr(getattr(plugin, name))) for name in vars(plugin)}

    return one is not None and other is not None and settings(one) == settings(other)


def launch_environment(path: str, drop: str | None = None) -> dict[str, str]:
    """The variables `accelerate launch --config_file path` gives each process (its own launch code), with the
    key `drop` of fsdp_config left out (a copy of the file without it)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    with tempfile.TemporaryDirectory() as folder:
        if drop is not None:
            raw = read_settings(path)
            raw["fsdp_config"] = {key: value for key, value in raw["fsdp_config"].items() if key != drop}
            path = str(Path(folder) / Path(path).name)
            Path(path).write_text(yaml.safe_dump(raw))
        args = launch_command_parser().parse_args(["--config_file", path, "--main_process_port", "1", "train.py"])
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                args, _, _ = _validate_launch_command(args)
                return dict(prepare_multi_gpu_env(args))
        except (ValueError, TypeError, KeyError) as error:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise UserError(f"{path}: accelerate launch would refuse it: {message}") from None


def read_settings(path: str) -> dict[str, Any]:
    """The file's settings as written: a mapping, read as YAML (or JSON for a .json file)."""
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
    range, the precision's name."""
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


def load_accelerate_config(path: str) -> Any:
    """accelerate's own loader, its errors as one line."""
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
    """The loaded config's topology and what its distributed type and precision need installed; returns the
    distributed type's name."""
    for key in ("num_processes", "num_machines"):
        value = getattr(config, key, 1)
        if key == "num_processes" and key not in raw:  # accelerate's own "not set" (-1): its launch says so below
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{path}: {key} must be a whole number >= 1, found {value!r}")
    if not 0 <= getattr(config, "machine_rank", 0) < config.num_machines:
        raise UserError(
            f"{path}: machine_rank must be between 0 and num_machines - 1 ({config.num_machines - 1}), "
            f"found {config.machine_rank!r}"
        )
    kind = str(config.distributed_type).split(".")[-1]
    for package in REQUIRED_PACKAGES.get(kind, ()):
        if importlib.util.find_spec(package) is None:
            raise UserError(f"{path}: distributed_type {kind} needs the {package} package, which is not installed")
    if raw.get("mixed_precision") == "fp8" and not any(importlib.util.find_spec(name) for name in FP8_BACKENDS):
        raise UserError(
            f"{path}: mixed_precision fp8 needs one of {', '.join(FP8_BACKENDS)} installed (and a GPU that has fp8)"
        )
    return kind


def validate_like_accelerate_launch(path: str) -> None:
    """accelerate launch's own validation of its arguments with this config file, in this process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            _validate_launch_command(args)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"{path}: accelerate launch would refuse it: {message}") from None


# what of an accelerate config a launcher that is not accelerate launch (ddp-accel ray) hands its workers
WORKER_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_FSDP")


def worker_environment(path: str) -> dict[str, str]:
    """The variables `accelerate launch --config_file path` gives each process for its precision and its strategy
    (FSDP and its FSDP_* settings), from Accelerate's own launch code; one line where the file cannot be launched,
    or asks for a strategy other than DDP or FSDP (the process counts are the launcher's own)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    check_config(path)
    args = launch_command_parser().parse_args(["--config_file", path, "--main_process_port", "1", "train.py"])
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, _, _ = _validate_launch_command(args)
            if args.use_deepspeed or args.use_megatron_lm or args.tpu:
                raise UserError(f"{path}: ddp-accel ray runs DDP or FSDP; this config is for accelerate launch")
            environment = prepare_multi_gpu_env(args)
    except (ValueError, TypeError, KeyError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"{path}: accelerate launch would refuse it: {message}") from None
    return {name: value for name, value in environment.items() if name in WORKER_VARIABLES or name.startswith("FSDP_")}
