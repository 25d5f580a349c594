"""`ddp-accel check-config FILE`: validate an accelerate YAML before launching with it
(ddp_accel/accelerate_config.py): exit 0 when it runs here, 2 when it is invalid anywhere, 3 when it is valid but
not on this machine (a GPU precision without a GPU, a package not installed).
`ddp-accel doctor`: check the machines under the launcher you train with (ddp_accel/doctor.py).
`ddp-accel shard images SRC OUT`: an ImageFolder as WebDataset tar shards (ddp_accel/vision/shards.py).
`ddp-accel shard text FILE OUT`: a jsonl/csv/parquet file of reviews as jsonl or parquet shards
(ddp_accel/text/streamed.py).

`accelerate launch` answers a bad config with a long traceback; this says what is wrong in one line.
"""

from __future__ import annotations

import argparse
import sys

from ddp_accel.accelerate_config import check_config
from ddp_accel.cli import ArgumentParser, nonnegative, positive, positive_int
from ddp_accel.config_file import NotOnThisMachine
from ddp_accel.errors import UserError
from ddp_accel.startup import TEXT_EXTRA, require


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
    doctor.add_argument(
        "--min-free-gb", type=nonnegative, default=5.0, help="less free disk than this under --output-dir is a problem"
    )
    shard = commands.add_parser(
        "shard", help="write shards read in place: from an ImageFolder or a file of reviews: ddp-accel shard --help"
    )
    shard.add_argument(
        "kind",
        choices=["images", "text"],
        help="images: an ImageFolder (train/<class>/*, val/<class>/*) as tar shards; text: a jsonl/csv/parquet file "
        "with text and label columns as jsonl or parquet shards",
    )
    shard.add_argument("source", help="the ImageFolder root, or the file of reviews")
    shard.add_argument("output", help="where the shards (and their manifest.json) go: images: OUT/train, OUT/val")
    shard.add_argument("--samples-per-shard", type=positive_int, default=None, help="default: images 1000, text 10000")
    shard.add_argument("--seed", type=int, default=0, help="the samples' order in the training shards")
    shard.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="text: the shards' format")
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
    if args.command == "shard":
        try:
            for manifest in write_shards(args):
                print(f"wrote {manifest}")
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0
    if args.command == "doctor":
        from ddp_accel.doctor import run  # imports torch: not for check-config

        return run(args.output_dir, args.timeout_s, args.megabytes, args.data, args.min_free_gb)
    return check_configs(args.files)


def write_shards(args: argparse.Namespace) -> list:
    """The manifests `ddp-accel shard` wrote (the writers import torch: not for check-config)."""
    if args.kind == "text":
        require(["datasets"], TEXT_EXTRA, who="ddp-accel shard text")
        from ddp_accel.text.streamed import write_text_shards

        return [write_text_shards(args.source, args.output, args.samples_per_shard or 10_000, args.seed, args.format)]
    from ddp_accel.vision.shards import write_shards as write_image_shards

    return write_image_shards(args.source, args.output, args.samples_per_shard or 1000, args.seed)


def check_configs(paths: list[str]) -> int:
    """Each file's summary, or its problem in one line: exit 2 when one is invalid anywhere, else 3 when one is
    valid but not on this machine, else 0."""
    invalid = elsewhere = False
    for path in paths:
        try:
            print(check_config(path))
        except NotOnThisMachine as error:
            print(f"valid, but not on this machine: {error}", file=sys.stderr)
            elsewhere = True
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            invalid = True
    return 2 if invalid else 3 if elsewhere else 0


if __name__ == "__main__":
    sys.exit(main())
