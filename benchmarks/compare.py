"""Speed regressions caught like test failures: the key throughput figures of a base commit and of HEAD (the working
tree), run alternately on one machine, and their ratios.

    python benchmarks/compare.py --base main~1                    # against another commit
    python benchmarks/compare.py --base 729a739 --repeats 4 --cifar ../shared/data/cifar10_mini.tar.gz \
        --imdb ../shared/data/imdb_train.jsonl.gz

Figures (single process, the machine's threads):
- cifar: scripts/imagenet.py on CIFAR-10 images (cifar_resnet9_w16, 32 px, pad-crop + flip in 1 worker, batch 64,
  --max-steps 120): the steady samples/s of the image pipeline and model (metrics.json)
- imdb: scripts/imdb.py, the NB-weighted bag with bigrams in 1M buckets, sparse updates, 300 steps: train samples/s
- loop: benchmarks/overhead_accel.py (a 512-wide MLP, 8 epochs, one thread): samples/s through ddp_accel.fit. One
  thread and ~5 s of steps: with 2 epochs and the machine's threads, one run took 1.3 s and moved between ~26,000
  and ~35,000 samples/s on the same commit, a noise larger than what the figure is meant to catch
- --loops TASK:PROCESSES ...: more of benchmarks/overhead.py's workloads through ddp_accel.fit (mlp-512, mlp-2048,
  resnet20; 2 processes under torchrun, one thread each), e.g. `--loops mlp-512:2 mlp-2048:1 resnet20:1 resnet20:2`
Without --cifar / --imdb, generated images and the synthetic corpus stand in. Each figure is the median of
--repeats runs per side, base and HEAD alternated so that machine noise hits both alike. Exit 1 when a ratio
(HEAD / base) falls below --fail-below.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def make_images(root: Path) -> Path:
    """10 classes x 100 train / 20 val 32x32 JPEGs, when no CIFAR-10 archive is given."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", 100), ("val", 20)):
        for label in range(10):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                pixels = (rng.random((32, 32, 3)) * 80 + label * 17).astype("uint8")
                Image.fromarray(pixels).save(folder / f"{index}.jpg")
    return root


def image_folder(archive: str | None, work: Path) -> Path:
    if archive is None:
        return make_images(work / "images")
    with tarfile.open(archive) as tar:
        tar.extractall(work / "cifar", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return next(path.parent for path in (work / "cifar").rglob("train") if (path.parent / "val").is_dir())


LOOP_STEPS = {"mlp-512": 2048, "mlp-2048": 256, "resnet20": 128}  # optimizer steps: ~5-15 s of steps each


def loop_figure(tree: Path, work: Path, env: dict[str, str], loop: str) -> float:
    """samples/s of benchmarks/overhead_accel.py's TASK on PROCESSES processes (`mlp-512:2`), in `tree`."""
    task, _, processes = loop.partition(":")
    name, _, hidden = task.partition("-")
    script = [str(tree / "benchmarks" / "overhead_accel.py"), "--task", name, *(["--hidden", hidden] if hidden else [])]
    script += ["--epochs", "100", "--max-steps", str(LOOP_STEPS[task]), "--output-dir", str(work / "loop")]
    script += ["--overwrite-output-dir", "--log-steps", "1000000"]
    launcher = [sys.executable]
    if int(processes or 1) > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        launcher = [
            str(Path(sys.executable).parent / "torchrun"),
            "--nproc_per_node",
            processes,
            "--master_port",
            str(port),
        ]
    env = {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'benchmarks'}"}
    result = subprocess.run([*launcher, *script], cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{tree}: {loop} failed:\n{result.stderr[-3000:]}")
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith('{"loop"')))["samples_per_s"]


def figures(tree: Path, work: Path, images: Path, imdb: str | None, loops: list[str]) -> dict[str, float]:
    """One run of each benchmark in `tree`: samples/s."""
    env = {**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(work / "cache")}
    out = work / "out"

    def run(*command: str | Path) -> None:
        result = subprocess.run([sys.executable, *map(str, command)], cwd=tree, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{tree}: {' '.join(map(str, command))} failed:\n{result.stderr[-3000:]}")

    def metrics() -> dict:
        return json.loads((out / "metrics.json").read_text())

    found = {}
    run(
        "scripts/imagenet.py",
        images,
        "-a",
        "cifar_resnet9_w16",
        "--image-size",
        32,
        "--augment",
        "cifar",
        "-j",
        1,
        "-b",
        64,
        "--max-steps",
        120,
        "--epochs",
        100,
        "--output-dir",
        out,
        "--overwrite-output-dir",
    )
    found["cifar steady samples/s"] = metrics()["steady_samples_per_s"]
    data = ["--train-file", imdb] if imdb else ["--dataset", "synthetic"]
    # the same model on both sides (the default became trigrams in 4M buckets): the code's speed, not the recipe's
    run(
        "scripts/imdb.py",
        *data,
        "--ngrams",
        2,
        "--buckets",
        1_000_000,
        "--max-steps",
        300,
        "--output-dir",
        out,
        "--overwrite-output-dir",
    )
    found["imdb bag samples/s"] = metrics()["train_samples_per_s"]
    loop = subprocess.run(
        [
            sys.executable,
            "benchmarks/overhead_accel.py",
            "--output-dir",
            str(out),
            "--overwrite-output-dir",
            "--epochs",
            "8",
        ],
        cwd=tree,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    found["loop samples/s"] = json.loads(loop.stdout.strip().splitlines()[-1])["samples_per_s"]
    for extra in loops:
        found[f"loop {extra} samples/s"] = loop_figure(tree, work, env, extra)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare HEAD's working tree with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cifar", help="cifar10_mini.tar.gz (ImageFolder layout inside)")
    parser.add_argument("--imdb", help="a jsonl/csv/parquet file of reviews")
    parser.add_argument("--fail-below", type=float, default=0.9, help="exit 1 when a ratio is below this")
    parser.add_argument("--loops", nargs="*", default=[], help="more overhead workloads: TASK:PROCESSES")
    args = parser.parse_args()
    args.imdb = str(Path(args.imdb).resolve()) if args.imdb else None  # the runs' working folder is each tree
    with tempfile.TemporaryDirectory(prefix="ddp_accel_compare_") as tmp:
        work = Path(tmp)
        base = work / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True, capture_output=True
        )
        try:
            images = image_folder(args.cifar, work)
            runs: dict[str, dict[str, list[float]]] = {"base": {}, "HEAD": {}}
            for repeat in range(args.repeats):
                for side, tree in (
                    (("base", base), ("HEAD", ROOT)) if repeat % 2 == 0 else (("HEAD", ROOT), ("base", base))
                ):
                    for name, value in figures(tree, work / side, images, args.imdb, args.loops).items():
                        runs[side].setdefault(name, []).append(value)
                    print(f"run {repeat + 1}/{args.repeats} {side}: done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    print(f"| figure | base {args.base} (median) | HEAD (median) | HEAD / base | runs |")
    print("|---|---|---|---|---|")
    worst = float("inf")
    for name in runs["base"]:
        old, new = statistics.median(runs["base"][name]), statistics.median(runs["HEAD"][name])
        worst = min(worst, new / old)
        values = " / ".join(f"{a:.0f}:{b:.0f}" for a, b in zip(runs["base"][name], runs["HEAD"][name], strict=True))
        print(f"| {name} | {old:.0f} | {new:.0f} | {new / old:.2f}x | {values} |")
    if worst < args.fail_below:
        raise SystemExit(f"a figure fell to {worst:.2f}x of the base (below {args.fail_below})")


if __name__ == "__main__":
    main()
