"""Tar shards against the same images as an ImageFolder, and what a resume and a large manifest cost.

    python benchmarks/shards.py --images cifar10_mini.tar.gz --repeats 3
    python benchmarks/shards.py --only seek memory        # no images needed

- epoch: `scripts/imagenet.py` for one epoch (cifar_resnet20, 32 px, `-b 64 -j 2`) on an ImageFolder and on the
  same images written as tar shards (`ddp-accel shard images`), whole commands alternated, 1 and 2 processes
  (torchrun): metrics.json's train samples/s, medians.
- seek: a resume at 90% of an epoch of 1,000,000 samples (1,000 shards of 1,000): the time from the skipped loader's
  `iter()` to its first batch, through Accelerate's `skip_first_batches` of the canonical order (no sample read).
- memory: the peak RSS of a process that builds a manifest's order and walks one epoch of it, 10,000 against
  1,000,000 samples.
A markdown table goes to stdout and to benchmarks/results/shards.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent

SEEK = """
import time
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from ddp_accel.streaming import WindowShuffle

class Indices(Dataset):
    def __len__(self):
        return 1_000_000
    def __getitem__(self, index):
        return index

accelerator = Accelerator(cpu=True)
order = WindowShuffle([1000] * 1000, seed=0, window=4096)
loader = accelerator.prepare(DataLoader(Indices(), batch_size=64, sampler=order))
skipped = accelerator.skip_first_batches(loader, int(0.9 * len(loader)))
started = time.perf_counter()
first = next(iter(skipped))
print(time.perf_counter() - started)
"""

MEMORY = """
import resource, sys
from ddp_accel.streaming import WindowShuffle
shards = int(sys.argv[1])
total = 0
for index in WindowShuffle([1000] * shards, seed=0, window=4096):
    total += 1
print(total, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def image_folder(images: str, into: Path) -> Path:
    source = Path(images)
    if source.is_file():
        with tarfile.open(source) as archive:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(into / "source", **safe)  # noqa: S202
        source = next(path.parent for path in (into / "source").rglob("train") if path.is_dir())
    return source


def epoch_run(data: Path, nproc: int, output_dir: Path) -> float:
    """One epoch of imagenet.py on `data`: metrics.json's train samples/s."""
    work = ["-a", "cifar_resnet20", "--image-size", "32", "--augment", "cifar", "-b", "64", "-j", "2", "--epochs", "1"]
    script = [str(ROOT / "scripts" / "imagenet.py"), str(data), *work, "--output-dir", str(output_dir)]
    script += ["--overwrite-output-dir", "--mixed-precision", "no"]
    launcher = [sys.executable] if nproc == 1 else [str(BIN / "torchrun"), "--nproc_per_node", str(nproc)]
    if nproc > 1:
        launcher += ["--master_port", str(29500 + os.getpid() % 1000)]
    result = subprocess.run([*launcher, *script], capture_output=True, text=True, cwd=ROOT, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{data} x{nproc} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return json.loads((output_dir / "metrics.json").read_text())["train_samples_per_s"]


def epochs(images: str, repeats: int, temp: Path) -> list[str]:
    folder = image_folder(images, temp)
    shards = temp / "shards"
    subprocess.run([sys.executable, "-m", "ddp_accel", "shard", "images", str(folder), str(shards)], check=True)
    rows = []
    for nproc in (1, 2):
        runs: dict[str, list[float]] = {"folder": [], "shards": []}
        for repeat in range(repeats):
            for name in ("folder", "shards") if repeat % 2 == 0 else ("shards", "folder"):
                runs[name].append(epoch_run(folder if name == "folder" else shards, nproc, temp / "out"))
                print(f"  x{nproc} {name}: {runs[name][-1]:.0f} samples/s", file=sys.stderr, flush=True)
        folder_rate, shard_rate = statistics.median(runs["folder"]), statistics.median(runs["shards"])
        pairs = ", ".join(f"{a:.0f}:{b:.0f}" for a, b in zip(runs["folder"], runs["shards"], strict=True))
        rows.append(
            f"| epoch, {nproc} process(es): samples/s, ImageFolder vs shards | {folder_rate:.0f} | {shard_rate:.0f} "
            f"| {shard_rate / folder_rate:.2f}x ({pairs}) |"
        )
    return rows


def seek() -> list[str]:
    times = [float(run_python(SEEK).strip().splitlines()[-1]) for _ in range(3)]
    return [
        f"| resume at 90% of a 1,000,000-sample epoch: iter() -> first batch | | {statistics.median(times):.2f} s | |"
    ]


def memory() -> list[str]:
    small, large = (run_python(MEMORY, str(shards)).split() for shards in (10, 1000))
    return [
        f"| peak RSS walking an epoch's order: 10,000 vs 1,000,000 samples | {float(small[1]):.0f} MiB "
        f"| {float(large[1]):.0f} MiB | {float(large[1]) / float(small[1]):.2f}x |"
    ]


def run_python(code: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, check=True)
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", help="an ImageFolder root (train/, val/) or a .tar.gz of one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=["epoch", "seek", "memory"], default=["epoch", "seek", "memory"])
    args = parser.parse_args()
    rows = ["| figure | base | measured | ratio |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="shards_bench_") as temp:
        if "epoch" in args.only:
            if not args.images:
                raise SystemExit("--images: the ImageFolder (or its .tar.gz) the epochs read")
            rows += epochs(args.images, args.repeats, Path(temp))
        if "seek" in args.only:
            rows += seek()
        if "memory" in args.only:
            rows += memory()
    table = "\n".join(rows)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    command = " ".join(["python", "benchmarks/shards.py", *sys.argv[1:]])
    (HERE / "results" / "shards.md").write_text(f"`{command}`\n\n{table}\n")


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"({time.time() - started:.0f} s)", file=sys.stderr)
