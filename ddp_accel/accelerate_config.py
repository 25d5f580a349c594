"""`ddp-accel check-config FILE` and `ddp-accel launch`'s check of its config: an accelerate YAML validated before
a launch, with one line for what is wrong (`accelerate launch` answers a bad config with a long traceback)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ddp_accel.config_file import NotOnThisMachine, check_anywhere, check_this_machine, has_accelerator, read_settings
from ddp_accel.errors import UserError
from ddp_accel.sharding import CPU_FSDP2_ONLY, cpu_fsdp_problem, fsdp_plugin


def check_config(path: str) -> str:
    """Load `path` with accelerate's own loader and launch-argument validation, plus what accelerate launch would
    reject later (port range, precision, packages); return a one-line summary, or raise UserError (invalid anywhere)
    or NotOnThisMachine (valid, but this machine cannot run it). Never a traceback."""
    raw, config, kind = check_anywhere(path)
    validate_like_accelerate_launch(path)
    summary = f"{path}: {kind}, {config.num_processes} process(es) on {config.num_machines} machine(s)"
    notes = check_fsdp(path, raw) if kind == "FSDP" else []
    check_this_machine(path, raw, kind)
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
    settings = raw.get("fsdp_config") or {}
    environment = launch_environment(path)
    cpu = not has_accelerator()  # ddp_accel runs FSDP2 over gloo there; FSDP1's plugin wants a GPU to be built
    if cpu and environment.get("FSDP_VERSION", "1") == "1":
        raise NotOnThisMachine(f"{path}: {CPU_FSDP2_ONLY}")
    plugin = in_file(path, lambda: fsdp_plugin(environment))  # what Accelerate builds: valid anywhere
    problem = cpu_fsdp_problem(plugin) if cpu else None
    if problem is not None:
        raise NotOnThisMachine(f"{path}: {problem}")
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
    with tempfile.TemporaryDirectory() as folder:
        if drop is not None:
            raw = read_settings(path)
            raw["fsdp_config"] = {key: value for key, value in raw["fsdp_config"].items() if key != drop}
            path = str(Path(folder) / Path(path).name)
            Path(path).write_text(yaml.safe_dump(raw))
        return accelerate_launch_environment(["--config_file", path, "train.py"], f"{path}: accelerate launch")


def process_variables(arguments: list[str]) -> dict[str, str]:
    """What `accelerate launch ARGUMENTS` adds to the environment of each process it starts (the precision, dynamo,
    the debug mode, the visible devices, FSDP's settings), for a launcher of ours that starts the processes itself
    (`ddp-accel launch --recover in-process`: the rendezvous is its own)."""
    from accelerate.utils import check_cuda_p2p_ib_support

    environment = accelerate_launch_environment(arguments, "accelerate launch")
    if not check_cuda_p2p_ib_support():  # GPUs whose P2P and InfiniBand NCCL must not use (accelerate launch's check)
        environment = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", **environment}
    return {name: value for name, value in environment.items() if os.environ.get(name) != value}


def accelerate_launch_environment(arguments: list[str], who: str) -> dict[str, str]:
    """The whole environment `accelerate launch ARGUMENTS` gives each process, from its own launch code; a UserError
    (`{who} would refuse it: ...`) where it would refuse them."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(arguments)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, _, _ = _validate_launch_command(args)
            args.main_process_port = 1  # (no port to check: nothing is launched)
            return dict(prepare_multi_gpu_env(args))
    except (ValueError, TypeError, KeyError, RuntimeError) as error:  # (RuntimeError: fp8 without its package)
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"{who} would refuse it: {message}") from None


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

    with contextlib.suppress(NotOnThisMachine):  # the workers' machines are the ones to run it (a GPU there)
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
