"""IMDB `bag` with 1M n-gram buckets: dense vs sparse embedding gradients, 1 vs 2 processes at the same global
batch (1 x 128, 2 x 64), alternated in one run; and the bytes each step all-reduces.

    python benchmarks/imdb_sparse.py --train-file imdb_train.jsonl.gz --epochs 1 --repeats 1

Writes benchmarks/results/imdb_sparse.md. Preprocessing is done once first (a shared cache), so the runs time
the training; wall time and held-out accuracy of each run are reported too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent


def run(args, sparse: str, processes: int, work: str, name: str) -> dict:
    out = f"{work}/{name}"
    script = [str(ROOT / "scripts" / "imdb.py"), "--train-file", args.train_file, "--buckets", str(args.buckets),
              "--epochs", str(args.epochs), "--sparse", sparse, "--batch-size", str(128 // processes),
              "--cache-dir", f"{work}/cache", "--output-dir", out, "--overwrite-output-dir"]
    launcher = ([str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "multi_gpu.yaml"),
                 "--num_processes", str(processes)] if processes > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes)), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    result = subprocess.run([*launcher, *script], capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    metrics = json.loads(Path(out, "metrics.json").read_text())
    return {"wall_s": wall, "samples_per_s": metrics["train_samples_per_s"], "accuracy": metrics["eval_accuracy"],
            "train_s": metrics["train_samples"] / metrics["train_samples_per_s"]}


def bytes_per_step(args, work: str) -> tuple[int, float]:
    """Dense: the whole table and the head. Sparse: the rows one global batch touches (values + indices)."""
    sys.path.insert(0, str(ROOT))
    from ddp_accel.text.models import NgramBag
    from ddp_accel.text.pipeline import make_loader
    from ddp_accel.text.vocab import Vocab
    import datasets
    vocab = Vocab.load(Path(work, "dense_1", "vocab.json"))
    train = datasets.Dataset.from_file(str(next(Path(work, "cache").glob("train-*-ids.arrow"))))
    model = NgramBag(len(vocab), vocab.pad_id, dim=64, ngrams=2, buckets=args.buckets)
    loader = make_loader(train, 128, vocab.pad_id, shuffle=True, seed=0)
    rows = []
    for index, (input_ids, _) in enumerate(loader):
        rows.append(len(model.ngram_ids(input_ids).unique()))
        if index == 50:
            break
    dense = sum(p.numel() for p in model.parameters()) * 4
    sparse = statistics.mean(rows) * (64 * 4 + 8) + (64 * 2 + 2) * 4
    return dense, sparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-file", required=True)
    parser.add_argument("--buckets", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    configs = [("off", 1), ("on", 1), ("off", 2), ("on", 2)]
    results = {config: [] for config in configs}
    with tempfile.TemporaryDirectory() as work:
        run(args, "on", 1, work, "warm_cache")  # tokenise and encode once
        for repeat in range(args.repeats):
            for sparse, processes in configs if repeat % 2 == 0 else reversed(configs):
                name = f"{'sparse' if sparse == 'on' else 'dense'}_{processes}"
                results[(sparse, processes)].append(run(args, sparse, processes, work, name))
                print(f"  {name}: {results[(sparse, processes)][-1]}", file=sys.stderr, flush=True)
        dense_bytes, sparse_bytes = bytes_per_step(args, work)
    rows = [f"`python benchmarks/imdb_sparse.py --train-file ... --buckets {args.buckets} --epochs {args.epochs} "
            f"--repeats {args.repeats}` (global batch 128)", "",
            "| embedding gradients | processes | train samples/s | training (s) | wall (s) | held-out accuracy | bytes all-reduced per step |",
            "|---|---|---|---|---|---|---|"]
    for sparse, processes in configs:
        runs = results[(sparse, processes)]
        median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        size = (sparse_bytes if sparse == "on" else dense_bytes) if processes > 1 else 0
        rows.append(f"| {'sparse' if sparse == 'on' else 'dense'} | {processes} | {median['samples_per_s']:,.0f} | "
                    f"{median['train_s']:.0f} | {median['wall_s']:.0f} | {median['accuracy']:.2%} | "
                    f"{f'{size / 1e6:,.1f} MB' if size else 'none'} |")
    table = "\n".join(rows)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "imdb_sparse.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
