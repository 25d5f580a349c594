"""Real JPEGs at GPU speed: ResNet-50 (bf16, channels_last) through scripts/imagenet.py on a folder of ImageNet-like
JPEGs, decoded on the GPU (`--decode-on device`) and by PIL in the loader workers (`--decode-on loader`), against
synthetic images (`--dummy`, no decoding at all), alternated on one card.

    python benchmarks/gpu_jpeg.py --images /tmp/jpegs --make 20x640     # 20 classes x 640 JPEGs (500x375, q90)
    python benchmarks/gpu_jpeg.py --images /tmp/jpegs --smoke           # a CPU try of the whole path, tiny model

The images are drawn once (a process per core, a progress bar) and kept: smooth colour fields with grain, which
compress to about 70 KiB each (ImageNet's photos: about 110 KiB). Images/s are steady-state (the first
log window left out). Writes gpu_jpeg.md (the table) and gpu_jpeg.json beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_resnet50 import WARMUP_STEPS, run  # noqa: E402

CONFIGS = {  # name -> (uses the folder, options)
    "synthetic (--dummy)": (False, []),
    "JPEGs decoded on the device": (True, ["--decode-on", "device"]),
    "JPEGs decoded by PIL in the workers": (True, ["--decode-on", "loader"]),
}


def draw_image(job: tuple[Path, int]) -> int:
    """One 500x375 JPEG (quality 90): a smooth field of colour with grain; its size in bytes."""
    path, seed = job
    rng = np.random.default_rng(seed)
    field = Image.fromarray((rng.random((8, 10, 3)) * 255).astype(np.uint8)).resize((500, 375), Image.BICUBIC)
    grain = rng.normal(0, 12, (375, 500, 3))
    pixels = np.clip(np.asarray(field, dtype=np.float64) + grain, 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=90)
    return path.stat().st_size


def make_folder(root: Path, classes: int, per_class: int) -> None:
    """ROOT/train/<class>/*.jpg (per_class each) and ROOT/val/<class>/*.jpg (a tenth as many)."""
    jobs = []
    for split, count in (("train", per_class), ("val", max(per_class // 10, 1))):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs += [(folder / f"{i}.jpg", (split == "val") * 10**8 + c * 10**5 + i) for i in range(count)]
    with multiprocessing.Pool(os.cpu_count()) as pool:
        sizes = list(tqdm(pool.imap_unordered(draw_image, jobs, chunksize=16), total=len(jobs), desc="JPEGs"))
    print(f"{len(jobs)} JPEGs in {root}, {statistics.mean(sizes) / 1024:.0f} KiB on average", flush=True)


def measure(args, name: str, folder: bool, options: list[str]) -> dict:
    out = Path(args.out) / "runs" / name.split(" ")[0]
    command = [sys.executable, "scripts/imagenet.py", str(args.images) if folder else "--dummy"]
    command += ["-a", args.arch, "--image-size", str(args.image_size), "-b", str(args.batch_size)]
    command += ["-j", str(args.workers), "--max-steps", str(args.steps), "-p", str(WARMUP_STEPS)]
    command += ["--output-dir", str(out), "--overwrite-output-dir", *options]
    command += ["--mixed-precision", args.precision] + (["--channels-last"] if args.channels_last else [])
    status, wall = run(command, args.timeout)
    if status in ("timeout", "failed"):
        return {"config": name, "status": status, "wall_s": wall}
    metrics = json.loads((out / "metrics.json").read_text())
    images_per_s, wait = metrics["steady_samples_per_s"], metrics["data_wait_share"]
    return {"config": name, "status": "ok", "images_per_s": images_per_s, "data_wait_share": wait, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, required=True, help="the JPEG folder (made with --make)")
    parser.add_argument("--make", metavar="CLASSESxPER_CLASS", help="draw the folder first, e.g. 20x640")
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=400, help="seconds per run")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on small batches: tries the path on a CPU")
    args = parser.parse_args()
    args.arch, args.image_size, args.precision, args.channels_last = "resnet50", 224, "bf16", True
    if args.smoke:
        args.arch, args.image_size, args.precision, args.channels_last = "cifar_resnet20", 32, "no", False
        args.batch_size, args.workers, args.steps = 8, 2, WARMUP_STEPS + 5
    if args.make:
        classes, per_class = (int(part) for part in args.make.lower().split("x"))
        make_folder(args.images, classes, per_class)

    import torch

    if not (torch.cuda.is_available() or args.smoke):
        raise SystemExit("no CUDA GPU here: this benchmark measures GPU throughput (--smoke tries it on a CPU)")
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke run: not a figure)"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = []
    for _ in range(args.repeats):  # alternated, so drift hits every configuration alike
        for name, (folder, options) in CONFIGS.items():
            results.append(measure(args, name, folder, options))
            print(json.dumps(results[-1]), flush=True)
    lines = [
        f"{args.arch}, {args.precision}{', channels_last' if args.channels_last else ''}, batch {args.batch_size}, "
        f"-j {args.workers}, {args.steps} steps per run (first {WARMUP_STEPS} excluded), {args.repeats} runs each; "
        f"card: **{card}**, torch {torch.__version__}, {os.cpu_count()} CPU cores",
        "",
        "| input | images/s (median) | of --dummy | data wait | runs |",
        "|---|---|---|---|---|",
    ]
    ok = [r for r in results if r["status"] == "ok"]
    dummy = statistics.median([r["images_per_s"] for r in ok if r["config"] == "synthetic (--dummy)"] or [0])
    for name in CONFIGS:
        runs = [r for r in ok if r["config"] == name]
        if not runs:
            lines.append(f"| {name} | failed | | | |")
            continue
        speed = statistics.median(r["images_per_s"] for r in runs)
        wait = statistics.median(r["data_wait_share"] for r in runs)
        share = f"{speed / dummy:.0%}" if dummy else "-"
        each = ", ".join(f"{r['images_per_s']:,.0f}" for r in runs)
        lines.append(f"| {name} | {speed:,.0f} | {share} | {wait:.1%} | {each} |")
    (Path(args.out) / "gpu_jpeg.md").write_text("\n".join(lines) + "\n")
    (Path(args.out) / "gpu_jpeg.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
