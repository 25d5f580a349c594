"""DataLoader workers forked from the training process vs started by a forkserver, side by side in one run.

    python benchmarks/worker_start.py --cifar ../shared/data/cifar10_mini.tar.gz --python .venv/bin/python \
        --python /path/to/another/venv/bin/python

For each interpreter and each start method (`DDP_ACCEL_WORKER_START=fork|forkserver`, the variable
`ddp_accel.loaders` reads), a fresh process iterates the real CIFAR-10 ImageFolder pipeline of `imagenet.py`
(decode, pad-crop, flip, normalise) through `ddp_accel.loaders.batches` for several epochs, with new workers every
epoch as in training, and reports: the time to the first batch of the first epoch (the forkserver starts then) and of
the later epochs, the steady samples/s of the later epochs, the memory of the whole process tree (PSS: shared pages
counted once), and the time to the first batch when the dataset holds ImageNet's 1.28 million sample paths (the
dataset is pickled to each worker by a forkserver; a fork copies nothing). Runs alternate between the methods, the
median of --repeats is reported. A markdown table goes to stdout and to benchmarks/results/worker_start.md.
"""

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

from preemption import tree  # benchmarks/preemption.py: a process and every process below it

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METHODS = ("fork", "forkserver")


def tree_pss_mb(root: int) -> float:
    """PSS of `root` and every process below it (the forkserver and the workers), in MB."""
    total = 0
    for pid in tree(root):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class ImageNetSizedList:
    """ImageNet's 1.28M (path, class) pairs, as an ImageFolder holds them; returns a constant image."""

    def __init__(self) -> None:
        import torch

        self.samples = [(f"/data/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG", i % 1000) for i in range(1_281_167)]
        self.image = torch.zeros(3, 32, 32)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.image, self.samples[index][1]


def measure(data_dir: str, workers: int, epochs: int, batch_size: int) -> dict:
    """One process, one start method (from the environment): the CIFAR pipeline, then the ImageNet-sized list."""
    import torch
    from torch.utils.data import DataLoader

    from ddp_accel.loaders import batches, worker_start_method
    from ddp_accel.vision.data import image_folders, image_transforms

    torch.set_num_threads(1)
    cifar = image_transforms(32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), "cifar")
    train, _, _ = image_folders(data_dir, cifar, seed=0)
    first_batch, epoch_rates, pss = [], [], []
    for epoch in range(epochs):
        train.epoch = epoch
        loader = DataLoader(train, batch_size=batch_size, shuffle=True, num_workers=workers)
        start = time.perf_counter()
        samples = 0
        with batches(loader) as epoch_batches:
            for index, (images, _) in enumerate(epoch_batches):
                if index == 0:
                    first_batch.append(time.perf_counter() - start)
                if index == 10:
                    pss.append(tree_pss_mb(os.getpid()))
                samples += len(images)
        epoch_rates.append(samples / (time.perf_counter() - start))

    big = ImageNetSizedList()
    big_first = []
    for _ in range(2):
        loader = DataLoader(big, batch_size=batch_size, shuffle=False, num_workers=workers)
        start = time.perf_counter()
        with batches(loader) as big_batches:
            next(iter(big_batches))
            big_first.append(time.perf_counter() - start)
    return {
        "method": worker_start_method(),
        "python": sys.version.split()[0],
        "first_batch_epoch0_s": first_batch[0],
        "first_batch_later_s": statistics.median(first_batch[1:]),
        "steady_samples_per_s": statistics.median(epoch_rates[1:]),
        "tree_pss_mb": statistics.median(pss),
        "imagenet_list_first_batch_s": statistics.median(big_first),
    }


def run(python: str, method: str, args: argparse.Namespace, data_dir: str) -> dict:
    command = [python, __file__, "--child", data_dir, "--workers", str(args.workers), "--epochs", str(args.epochs)]
    env = {**os.environ, "DDP_ACCEL_WORKER_START": method, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command + ["--batch-size", str(args.batch_size)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{python} {method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cifar", help="cifar10_mini.tar.gz (ImageFolder layout inside)")
    parser.add_argument("--python", action="append", help="interpreters to compare (default: this one)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.workers, args.epochs, args.batch_size)))
        return
    if not args.cifar:
        parser.error("--cifar is required")
    with tempfile.TemporaryDirectory() as work:
        with tarfile.open(args.cifar) as archive:
            archive.extractall(work, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        data_dir = str(next(p.parent for p in Path(work).rglob("train") if p.is_dir()))
        rows = []
        for python in args.python or [sys.executable]:
            runs: dict[str, list[dict]] = {method: [] for method in METHODS}
            for _ in range(args.repeats):
                for method in METHODS:  # alternating: machine noise hits both alike
                    runs[method].append(run(python, method, args, data_dir))
            for method in METHODS:
                keys = [k for k in runs[method][0] if k not in ("method", "python")]
                row = {k: statistics.median(r[k] for r in runs[method]) for k in keys}
                rows.append({"python": runs[method][0]["python"], "method": method, **row})
    header = (
        "| Python | workers start by | first batch, epoch 0 (s) | first batch, later epochs (s) | steady samples/s "
        "| PSS of the process tree (MB) | first batch, 1.28M-path dataset (s) |"
    )
    lines = [header, "|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [
            row["python"],
            row["method"],
            f"{row['first_batch_epoch0_s']:.2f}",
            f"{row['first_batch_later_s']:.3f}",
        ]
        cells += [f"{row['steady_samples_per_s']:.0f}", f"{row['tree_pss_mb']:.0f}"]
        lines.append("| " + " | ".join([*cells, f"{row['imagenet_list_first_batch_s']:.2f}"]) + " |")
    table = "\n".join(lines)
    command = "python benchmarks/worker_start.py " + " ".join(sys.argv[1:])
    text = (
        f"# DataLoader worker start: fork vs forkserver\n\n`{command}`\n\n{args.workers} workers, batch "
        f"{args.batch_size}, {args.epochs} epochs of cifar10_mini (10,000 images) per run, median of {args.repeats} "
        f"alternating runs, {os.cpu_count()} cores.\n\n{table}\n"
    )
    (HERE / "results" / "worker_start.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
