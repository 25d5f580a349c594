"""`ddp-accel check-config FILE`: validate an accelerate YAML before launching with it.
`ddp-accel doctor`: check the machines under the launcher you train with (ddp_accel/doctor.py).

`accelerate launch` answers a bad config with a long traceback; this says what is wrong in one line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import yaml
from accelerate.commands.config.config_args import load_config_from_file

from ddp_accel.cli import ArgumentParser, positive, positive_int
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
    try:
        config = load_config_from_file(path)
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
    if precision == "fp8" and not any(importlib.util.find_spec(name) for name in FP8_BACKENDS):
        raise UserError(
            f"{path}: mixed_precision fp8 needs one of {', '.join(FP8_BACKENDS)} installed (and a GPU that has fp8)"
        )
    validate_like_accelerate_launch(path)
    summary = f"{path}: {kind}, {config.num_processes} process(es) on {config.num_machines} machine(s)"
    if kind in ("MULTI_GPU", "FSDP") and not has_accelerator():
        summary += (
            "; no GPU here: ddp_accel scripts run it as MULTI_CPU/gloo"
            if kind == "MULTI_GPU"
            else "; FSDP needs GPUs, it will not run on this machine"
        )
    return summary


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


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="ddp-accel", description="ddp-accel helper commands")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-config", help="validate accelerate YAML files")
    check.add_argument("files", nargs="+")
    doctor = commands.add_parser(
        "doctor", help="check the machines under the launcher you train with (network, versions, shared output dir)"
    )
    doctor.add_argument("--output-dir", help="the folder training will write to: is it shared, is there room")
    doctor.add_argument("--timeout-s", type=positive, default=30.0, help="how long to wait for the others")
    doctor.add_argument("--megabytes", type=positive_int, default=64, help="the all-reduce that measures bandwidth")
    doctor.add_argument("--data", help="a data file or folder: is it the same on every machine")
    commands.add_parser(
        "launch", help="accelerate launch whose wait for the other machines speaks and ends: ddp-accel launch --help"
    )
    ray = commands.add_parser("ray", help="run a training script on a Ray cluster (Ray Train): ddp-accel ray --help")
    from ddp_accel.ray_launch import add_arguments

    add_arguments(ray)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # accelerate launch's arguments pass through as they are
        from ddp_accel.launch import main as launch_main

        return launch_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "ray":
        from ddp_accel.ray_launch import RayJob, run_job

        return run_job(RayJob(**{key: value for key, value in vars(args).items() if key != "command"}))
    if args.command == "doctor":
        from ddp_accel.doctor import run  # imports torch: not for check-config

        return run(args.output_dir, args.timeout_s, args.megabytes, args.data)
    failed = False
    for path in args.files:
        try:
            print(check_config(path))
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            failed = True
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
