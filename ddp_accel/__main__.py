"""`ddp-accel check-config FILE`: validate an accelerate YAML before launching with it.

`accelerate launch` answers a bad config with a long traceback; this says what is wrong in one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ddp_accel.cli import ArgumentParser
from ddp_accel.errors import UserError
from ddp_accel.runtime import has_accelerator


def check_config(path: str) -> str:
    """Load `path` with accelerate's own loader; return a one-line summary or raise UserError."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    if Path(path).is_dir():
        raise UserError(f"{path} is a directory; pass a YAML file (the shipped ones are in accelerate_configs/)")
    if not Path(path).is_file():
        raise UserError(f"{path}: no such file; the shipped configs are in accelerate_configs/")
    if not Path(path).read_text().strip():
        raise UserError(f"{path} is empty; `accelerate config --config_file {path}` writes a valid file")
    try:
        config = load_config_from_file(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; the shipped configs are in accelerate_configs/") from None
    except yaml.YAMLError as error:
        raise UserError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    except (ValueError, TypeError) as error:
        message = str(error).splitlines()[0]
        if "unknown keys" in message:
            keys = message[message.index("(") + 1 : message.index(")")]
            raise UserError(
                f"{path}: unknown keys {keys}; fix or remove them (`accelerate config` writes a valid file)"
            ) from None
        raise UserError(f"{path}: {message}") from None
    for key in ("num_processes", "num_machines"):
        value = getattr(config, key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{path}: {key} must be a whole number >= 1, found {value!r}")
    if not 0 <= getattr(config, "machine_rank", 0) < config.num_machines:
        raise UserError(
            f"{path}: machine_rank must be between 0 and num_machines - 1 ({config.num_machines - 1}), "
            f"found {config.machine_rank!r}"
        )
    kind = str(config.distributed_type).split(".")[-1]
    summary = f"{path}: {kind}, {config.num_processes} process(es) on {config.num_machines} machine(s)"
    if kind in ("MULTI_GPU", "FSDP") and not has_accelerator():
        summary += (
            "; no GPU here: ddp_accel scripts run it as MULTI_CPU/gloo"
            if kind == "MULTI_GPU"
            else "; FSDP needs GPUs, it will not run on this machine"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="ddp-accel", description="ddp-accel helper commands")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-config", help="validate accelerate YAML files")
    check.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
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
