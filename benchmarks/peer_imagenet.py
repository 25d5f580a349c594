"""Ours against the peer's own script on the same work: pytorch/examples `imagenet/main.py`, unmodified, against
`scripts/imagenet.py`, whole processes timed in turn.

    python benchmarks/peer_imagenet.py --images cifar10_mini.tar.gz --repeats 3
    python benchmarks/peer_imagenet.py --peer-script ~/examples/imagenet/main.py --processes 1 2

The work: `-a resnet18 -b 32 -j 2 --epochs 1` (one epoch, then an evaluation of the val images), fp32 on the CPU,
`--images-per-class` training and a quarter as many val images of each class, from `--images` (an ImageFolder root or
a .tar.gz of one) or, without it, JPEGs drawn here. 2 processes: both under torchrun, each process with its own batch
of 32 (on a machine without GPUs the peer script divides nothing).

Reported, medians over the repeats: the whole command's wall time, the time from the command to the end of the first
step (the peer: its first log line, printed after step 1 (`-p 1`); ours: metrics.json's `first_step_at`), and steady
samples/s (all processes; the peer: its logged per-step times after the first two steps; ours: metrics.json's
`steady_samples_per_s`, after the first log window). A markdown table goes to stdout and to
benchmarks/results/peer_imagenet_Np.md.

Without `--peer-script`, the peer is fetched with git into a temporary folder at `--peer-commit`; it is not part of
this project (BSD-3-Clause, pytorch/examples).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from overhead import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
PEER_REPOSITORY = "https://github.com/pytorch/examples"
PEER_LOG_LINE = re.compile(r"Epoch: \[0\]\[\s*(\d+)/\d+\]\s+Time\s+([\d.]+)")


def fetch_peer(commit: str, into: Path) -> Path:
    clone = into / "examples"
    try:
        subprocess.run(["git", "clone", "-q", PEER_REPOSITORY, str(clone)], check=True, timeout=600)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
    except (OSError, subprocess.SubprocessError) as error:
        raise SystemExit(f"could not fetch {PEER_REPOSITORY} at {commit} ({error}); give --peer-script PATH") from None
    return clone / "imagenet" / "main.py"


def image_folder(images: str | None, per_class: int, into: Path) -> Path:
    """train/ and val/ with `per_class` and `per_class // 4` images of each class."""
    out = into / "images"
    if images is None:
        import numpy
        from PIL import Image  # drawn here: a colour per class and noise, 96 px, quality 90

        rng = numpy.random.default_rng(0)
        for split, count in (("train", per_class), ("val", per_class // 4)):
            for label in range(10):
                (out / split / f"class{label}").mkdir(parents=True, exist_ok=True)
                for index in range(count):
                    pixels = (label * 25 + rng.integers(0, 60, size=(96, 96, 3))).astype(numpy.uint8)
                    Image.fromarray(pixels).save(out / split / f"class{label}" / f"{index}.jpg", quality=90)
        return out
    source = Path(images)
    if source.is_file():
        with tarfile.open(source) as archive:
            # the "data" filter (no links out, no device files): Python 3.11.4+; Debian 12's 3.11.2 has none
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(into / "source", **safe)  # noqa: S202
        source = next(path.parent for path in (into / "source").rglob("train") if path.is_dir())
    for split, count in (("train", per_class), ("val", per_class // 4)):
        for class_dir in sorted(path for path in (source / split).iterdir() if path.is_dir()):
            (out / split / class_dir.name).mkdir(parents=True, exist_ok=True)
            for image in sorted(class_dir.iterdir())[:count]:
                shutil.copy(image, out / split / class_dir.name / image.name)
    return out


def commands(peer: Path, data: Path, nproc: int, output_dir: Path) -> dict[str, list[str]]:
    work = ["-a", "resnet18", "-b", "32", "-j", "2", "--epochs", "1", "-p", "1"]
    peer_help = peer.read_text()
    # the peer runs as it is, under benchmarks/peer_phases.py, which says when it reached each moment of its start-up
    peer_args = [str(HERE / "peer_phases.py"), str(peer), str(data), *work]
    peer_args += ["--no-accel"] if "--no-accel" in peer_help else []
    ours_args = [str(ROOT / "scripts" / "imagenet.py"), str(data), *work, "--mixed-precision", "no"]
    ours_args += ["--output-dir", str(output_dir), "--overwrite-output-dir"]
    if nproc == 1:
        return {"peer": [sys.executable, *peer_args], "ours": [sys.executable, *ours_args]}
    peer_args += ["--dist-url", "env://", "--dist-backend", "gloo"]

    def torchrun() -> list[str]:
        return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port())]

    return {"peer": torchrun() + peer_args, "ours": torchrun() + ours_args}


def run_one(name: str, command: list[str], cwd: Path, nproc: int, output_dir: Path) -> dict[str, float]:
    """One whole command: wall time, command -> end of the first step, steady samples/s of all processes."""
    started = time.time()
    first_line_at: list[float] = []
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            if not first_line_at and PEER_LOG_LINE.search(line):
                first_line_at.append(time.time())
            lines.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    process.wait()
    reader.join()
    wall = time.time() - started
    if process.returncode != 0:
        raise SystemExit(f"{name} x{nproc} failed:\n{''.join(lines)[-3000:]}")
    if name == "peer":
        step_times = [float(match.group(2)) for line in lines if (match := PEER_LOG_LINE.search(line))]
        # each rank logs its own steps; those after the first two are steady
        steady = nproc * 32 / statistics.median(step_times[2 * nproc :])
        phases = next(json.loads(line)["peer_phases"] for line in lines if line.startswith('{"peer_phases"'))
        return {"wall": wall, "first_step": first_line_at[0] - started, "steady": steady, **phase_moments(phases)}
    metrics = json.loads((output_dir / "metrics.json").read_text())
    figures = {
        "wall": wall,
        "first_step": metrics["first_step_at"] - started,
        "steady": metrics["steady_samples_per_s"],
    }
    return figures | phase_moments(metrics["startup_phases"])


# the moments of a start-up, each side's (ours: metrics.json's startup_phases; the peer's: peer_phases.py)
PHASES = {
    "imports": ("imports", "imports"),
    "process group (ours: the Accelerator)": ("accelerator", "process_group"),
    "data and model built": ("data_and_model", "data", "model"),
    "ready to train (ours: prepared, resumed, banner)": ("started", "data", "model"),
    "first batch": ("first_batch", "first_batch"),
    "first step's end": ("first_step", "first_step"),
}


def phase_moments(phases: dict[str, float]) -> dict[str, float]:
    """Seconds from the process's start to each moment of PHASES; a moment a side has not (the process group of one
    process) is the one before it."""
    moments: dict[str, float] = {}
    previous = 0.0
    for label, names in PHASES.items():
        found = [phases[name] for name in names if name in phases]
        previous = moments[f"at: {label}"] = max(found) if found else previous
    return moments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-script", help="pytorch/examples' imagenet/main.py (default: fetched with git)")
    parser.add_argument("--peer-commit", default="77f55b9", help="the peer's commit when it is fetched")
    parser.add_argument("--images", help="an ImageFolder root (train/, val/) or a .tar.gz of one (default: drawn)")
    parser.add_argument("--images-per-class", type=int, default=64, help="training images per class (val: 1/4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="peer_imagenet_") as temp:
        temp_dir = Path(temp)
        peer = Path(args.peer_script).resolve() if args.peer_script else fetch_peer(args.peer_commit, temp_dir)
        data = image_folder(args.images, args.images_per_class, temp_dir)
        run_dir = temp_dir / "run"  # the peer writes checkpoint.pth.tar into its working folder
        run_dir.mkdir()
        for nproc in args.processes:
            results: dict[str, list[dict[str, float]]] = {"peer": [], "ours": []}
            for repeat in range(args.repeats):
                for name in ("peer", "ours") if repeat % 2 == 0 else ("ours", "peer"):
                    output_dir = temp_dir / "ours_out"
                    command = commands(peer, data, nproc, output_dir)[name]
                    results[name].append(run_one(name, command, run_dir, nproc, output_dir))
                    print(f"{nproc} process(es), {name}: {results[name][-1]}", file=sys.stderr, flush=True)
            report(results, nproc, args)


def report(results: dict[str, list[dict[str, float]]], nproc: int, args: argparse.Namespace) -> None:
    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in results[name])

    def pairs(key: str) -> str:
        return ", ".join(
            f"{peer[key]:.1f}:{ours[key]:.1f}" for peer, ours in zip(results["peer"], results["ours"], strict=True)
        )

    rows = [
        f"# pytorch/examples imagenet/main.py vs scripts/imagenet.py, {nproc} process(es)",
        "",
        f"`python benchmarks/peer_imagenet.py {' '.join(sys.argv[1:])}`",
        "",
        f"resnet18, batch 32 per process, 2 workers per process, 1 epoch of {args.images_per_class * 10} training and "
        f"{args.images_per_class // 4 * 10} val images, fp32 on the CPU; medians of {args.repeats} alternated runs",
        "",
        "| figure | peer | ours | ours / peer (time: peer / ours) | runs (peer:ours) |",
        "|---|---|---|---|---|",
    ]
    for key, label, higher_is_better in (
        ("wall", "whole command (s)", False),
        ("first_step", "command -> end of the first step (s)", False),
        ("steady", "steady samples/s, all processes", True),
    ):
        peer, ours = median("peer", key), median("ours", key)
        ratio = ours / peer if higher_is_better else peer / ours
        rows.append(f"| {label} | {peer:.2f} | {ours:.2f} | {ratio:.3f}x | {pairs(key)} |")
    rows += [
        "",
        "Where the start-up goes, rank 0 (seconds from the process's start to each moment; the phase's own time):",
        "",
        "| moment | peer | ours | phase: peer | ours |",
        "|---|---|---|---|---|",
    ]
    before = {"peer": 0.0, "ours": 0.0}
    for label in PHASES:
        at = {name: median(name, f"at: {label}") for name in ("peer", "ours")}
        rows.append(
            f"| {label} | {at['peer']:.2f} | {at['ours']:.2f} | {at['peer'] - before['peer']:.2f} "
            f"| {at['ours'] - before['ours']:.2f} |"
        )
        before = at
    text = "\n".join(rows) + "\n"
    print(text)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"peer_imagenet_{nproc}p.md").write_text(text)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
