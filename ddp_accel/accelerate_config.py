"""`ddp-accel check-config FILE` and `ddp-accel launch`'s check of its config: an accelerate YAML validated before
a launch, with one line for what is wrong (`accelerate launch` answers a bad config with a long traceback)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import yaml
from accelerate.commands.config.config_args import load_config_from_file

from ddp_accel.errors import UserError
from ddp_accel.runtime import has_accelerator

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
    if kind in ("MULTI_GPU", "FSDP") and not has_accelerator():
        summary += (
            "; no GPU here: ddp_accel scripts run it as MULTI_CPU/gloo"
            if kind == "MULTI_GPU"
            else "; no GPU here: ddp_accel scripts run it as FSDP2 on the CPU over gloo"
        )
    return summary


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
