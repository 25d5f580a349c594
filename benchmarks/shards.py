"""Shards against the same data held otherwise (images as an ImageFolder, reviews as one file), and what a resume
and a large manifest cost.

    python benchmarks/shards.py --images cifar10_mini.tar.gz --reviews imdb_train.jsonl.gz --repeats 3
    python benchmarks/shards.py --only seek memory        # no data needed

- epoch: `scripts/imagenet.py` for one epoch (cifar_resnet20, 32 px, `-b 64 -j 2`) on an ImageFolder and on the
  same images written as tar shards (`ddp-accel shard images`), whole commands alternated, 1 and 2 processes
  (torchrun): metrics.json's train samples/s, medians.
- text: `scripts/imdb.py` for one epoch (a light model: bag of words, 64 reviews a batch, `--workers 2`, 1
  process) on a jsonl file (tokenised and encoded ahead, into the cache) and on the same reviews as jsonl shards
  (each review read, tokenised and encoded by a worker when its batch comes): train samples/s, and the preparation
  before the first step (the file: loading, tokenising, encoding; the shards: the vocabulary's pass), medians.
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


def text_run(data: Path, output_dir: Path, cache: Path) -> tuple[float, float]:
    """One epoch of imdb.py on `data`: (train samples/s, preprocess_s) from metrics.json."""
    work = ["--model", "bag", "--ngrams", "1", "--nb-weights", "off", "--batch-size", "64", "--workers", "2"]
    work += ["--epochs", "1", "--val-fraction", "0", "--cache-dir", str(cache)]
    script = [sys.executable, str(ROOT / "scripts" / "imdb.py"), "--train-file", str(data), *work]
    result = subprocess.run(
        [*script, "--output-dir", str(output_dir), "--overwrite-output-dir"], capture_output=True, text=True, cwd=ROOT
    )
    if result.returncode != 0:
        raise SystemExit(f"{data} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    metrics = json.loads((output_dir / "metrics.json").read_text())
    return metrics["train_samples_per_s"], metrics["preprocess_s"]


def texts(reviews: str, repeats: int, temp: Path) -> list[str]:
    source = Path(reviews)
    shards = temp / "text_shards"
    subprocess.run([sys.executable, "-m", "ddp_accel", "shard", "text", str(source), str(shards)], check=True)
    runs: dict[str, list[tuple[float, float]]] = {"file": [], "shards": []}
    for repeat in range(repeats):
        for name in ("file", "shards") if repeat % 2 == 0 else ("shards", "file"):
            # a fresh cache for each: the preparation is measured from nothing, as a first run pays it
            cache = temp / f"cache_{name}_{repeat}"
            runs[name].append(text_run(source if name == "file" else shards, temp / "out", cache))
            print(f"  text {name}: {runs[name][-1][0]:.0f} samples/s", file=sys.stderr, flush=True)
    rate = {name: statistics.median(rate for rate, _ in values) for name, values in runs.items()}
    prepare = {name: statistics.median(seconds for _, seconds in values) for name, values in runs.items()}
    return [
        f"| text epoch, 1 process: samples/s, one file vs shards | {rate['file']:.0f} | {rate['shards']:.0f} "
        f"| {rate['shards'] / rate['file']:.2f}x |",
        f"| text: preparation before the first step (file: tokenise + encode; shards: vocabulary pass) "
        f"| {prepare['file']:.1f} s | {prepare['shards']:.1f} s | {prepare['shards'] / prepare['file']:.2f}x |",
    ]


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
    parser.add_argument("--reviews", help="a jsonl file of reviews (text, label), gzipped or not")
    parser.add_argument("--repeats", type=int, default=3)
    kinds = ["epoch", "text", "seek", "memory"]
    parser.add_argument("--only", nargs="+", choices=kinds, default=kinds)
    args = parser.parse_args()
    rows = ["| figure | base | measured | ratio |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="shards_bench_") as temp:
        if "epoch" in args.only:
            if not args.images:
                raise SystemExit("--images: the ImageFolder (or its .tar.gz) the epochs read")
            rows += epochs(args.images, args.repeats, Path(temp))
        if "text" in args.only:
            if not args.reviews:
                raise SystemExit("--reviews: the jsonl file of reviews the text epochs read")
            rows += texts(args.reviews, args.repeats, Path(temp))
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
