"""IMDB `bag` with 1M n-gram buckets: dense vs sparse embedding gradients, 1 vs 2 processes at the same global
batch (1 x 128, 2 x 64), alternated in one run; and the bytes each step all-reduces.

    python benchmarks/imdb_sparse.py --train-file imdb_train.jsonl.gz --epochs 1 --repeats 1

Writes benchmarks/results/imdb_sparse.md. Preprocessing is done once first (a shared cache), so the runs time
the training; wall time and held-out accuracy of each run are reported too. A second table splits one sparse
step into its phases on 1 and 2 processes (the median of 50 steps; the gradients all-reduced on gloo as DDP
does, the all-reduce phase including any wait for the slower process): where the time of 2 processes goes.
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
    script = [
        str(ROOT / "scripts" / "imdb.py"),
        "--train-file",
        args.train_file,
        "--buckets",
        str(args.buckets),
        "--epochs",
        str(args.epochs),
        "--sparse",
        sparse,
        "--batch-size",
        str(128 // processes),
        "--cache-dir",
        f"{work}/cache",
        "--output-dir",
        out,
        "--overwrite-output-dir",
    ]
    launcher = (
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / "multi_gpu.yaml"),
            "--num_processes",
            str(processes),
        ]
        if processes > 1
        else [sys.executable]
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes)), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    result = subprocess.run([*launcher, *script], capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    metrics = json.loads(Path(out, "metrics.json").read_text())
    return {
        "wall_s": wall,
        "samples_per_s": metrics["train_samples_per_s"],
        "accuracy": metrics["eval_accuracy"],
        "train_s": metrics["train_samples"] / metrics["train_samples_per_s"],
    }


def load_encoded(work: str):
    """The vocabulary and the encoded training reviews the runs in `work` made (every run shares one cache)."""
    sys.path.insert(0, str(ROOT))
    import datasets

    from ddp_accel.text.vocab import Vocab

    vocab = Vocab.load(Path(work, "sparse_1", "vocab.json"))
    return vocab, datasets.Dataset.from_file(str(next(Path(work, "cache").glob("train-*-ids.arrow"))))


def bytes_per_step(args, work: str) -> tuple[int, float]:
    """Dense: the whole table and the head. Sparse: the rows one global batch touches (values + indices)."""
    vocab, train = load_encoded(work)
    from ddp_accel.text.models import NgramBag, TextModelConfig
    from ddp_accel.text.pipeline import PadCollate, make_loader

    model = NgramBag(len(vocab), vocab.pad_id, TextModelConfig("bag", dim=64, ngrams=2, buckets=args.buckets))
    loader = make_loader(train, 128, PadCollate(vocab.pad_id), shuffle=True, seed=0)
    rows = []
    for index, (input_ids, _) in enumerate(loader):
        rows.append(len(model.ngram_ids(input_ids).unique()))
        if index == 50:
            break
    dense = sum(p.numel() for p in model.parameters()) * 4
    sparse = statistics.mean(rows) * (64 * 4 + 8) + (64 * 2 + 2) * 4
    return dense, sparse


def phases_worker(work: str, buckets: int, steps: int = 60) -> None:
    """One sparse step split into phases; run under torchrun. The all-reduce is DDP's (gloo all-reduces the
    table's sparse gradient, then the head's dense one), called explicitly so that each phase has its own clock;
    DDP cannot overlap it with the backward anyway, as the table's gradient is the last one computed."""
    import torch
    import torch.distributed as dist

    vocab, train = load_encoded(work)
    from ddp_accel.optim import SparseAdamW
    from ddp_accel.text.models import NgramBag, TextModelConfig
    from ddp_accel.text.pipeline import PadCollate, make_loader

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = TextModelConfig("bag", dim=64, ngrams=2, buckets=buckets, nb_weights=True)
    model = NgramBag(len(vocab), vocab.pad_id, config, sparse=True)
    table_optimizer = SparseAdamW([model.embedding.weight], lr=5e-3, weight_decay=0.5)
    head_optimizer = torch.optim.AdamW([model.fc.weight, model.fc.bias], lr=5e-3, weight_decay=0.5, fused=True)
    loader = make_loader(train, 128 // world, PadCollate(vocab.pad_id), shuffle=True, seed=0)
    batches = [batch for index, batch in zip(range(steps * world), loader, strict=False) if index % world == rank]
    times = {name: [] for name in ("forward", "backward", "all-reduce", "table update", "head update", "whole step")}
    for index, (input_ids, labels) in enumerate(batches):
        clock = [time.perf_counter()]
        loss = torch.nn.functional.cross_entropy(model(input_ids), labels)
        clock.append(time.perf_counter())
        loss.backward()
        clock.append(time.perf_counter())
        if world > 1:
            for parameter in (model.embedding.weight, model.fc.weight, model.fc.bias):
                dist.all_reduce(parameter.grad)
                parameter.grad /= world
        clock.append(time.perf_counter())
        table_optimizer.step()
        clock.append(time.perf_counter())
        head_optimizer.step()
        clock.append(time.perf_counter())
        table_optimizer.zero_grad()
        head_optimizer.zero_grad()
        if index >= 10:
            for name, begin, end in zip(times, clock, clock[1:], strict=False):
                times[name].append(end - begin)
            times["whole step"].append(clock[-1] - clock[0])
    if rank == 0:
        print(json.dumps({name: statistics.median(values) * 1000 for name, values in times.items()}))


PHASE_RUNS = {"1 process, 2 threads, 128 reviews": 1, "2 processes, 1 thread and 64 reviews each": 2}


def phases(args, work: str) -> dict[str, dict[str, float]]:
    result = {}
    for name, processes in PHASE_RUNS.items():
        command = [
            str(BIN / "torchrun"),
            "--nproc_per_node",
            str(processes),
            "--standalone",
            __file__,
            "--phases-worker",
            work,
            "--buckets",
            str(args.buckets),
            "--train-file",
            args.train_file,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes))}
        output = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
        if output.returncode != 0:
            raise SystemExit(f"phases of {name} failed:\n{output.stderr[-3000:]}")
        result[name] = json.loads(output.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-file", required=True)
    parser.add_argument("--buckets", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--phases-worker", metavar="WORK_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phases_worker:
        return phases_worker(args.phases_worker, args.buckets)
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
        step_phases = phases(args, work)
    rows = [
        f"`python benchmarks/imdb_sparse.py --train-file ... --buckets {args.buckets} --epochs {args.epochs} "
        f"--repeats {args.repeats}` (global batch 128)",
        "",
        "| embedding gradients | processes | train samples/s | training (s) | wall (s) | held-out accuracy "
        "| bytes all-reduced per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for sparse, processes in configs:
        runs = results[(sparse, processes)]
        median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        size = (sparse_bytes if sparse == "on" else dense_bytes) if processes > 1 else 0
        rows.append(
            f"| {'sparse' if sparse == 'on' else 'dense'} | {processes} | {median['samples_per_s']:,.0f} | "
            f"{median['train_s']:.0f} | {median['wall_s']:.0f} | {median['accuracy']:.2%} | "
            f"{f'{size / 1e6:,.1f} MB' if size else 'none'} |"
        )
    rows += [
        "",
        "One sparse step (global batch 128), median ms",
        "",
        f"| phase | {' | '.join(PHASE_RUNS)} |",
        "|---|" + "---|" * len(PHASE_RUNS),
    ]
    rows += [
        f"| {phase} | " + " | ".join(f"{step_phases[run][phase]:.1f}" for run in PHASE_RUNS) + " |"
        for phase in step_phases[next(iter(PHASE_RUNS))]
    ]
    table = "\n".join(rows)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "imdb_sparse.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
