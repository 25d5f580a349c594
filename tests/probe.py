"""A training job instrumented for the tests: the real ddp_accel loop, recording what each rank saw.

Each sample is (id, x, y). Every rank writes `seen_rank{R}.json` (the ids of every training batch it
consumed, in order) to OUTPUT_DIR. Evaluation returns the ids it was given, so the test can check that
every validation sample was counted exactly once.
"""

import signal

# A preemption signal during the imports below ends the process at once with its marker (ddp_accel/startup.py);
# only when run as a script: a program that imports this module keeps its own signal handling
if __name__ == "__main__":
    from ddp_accel.startup import stop_during_imports

    stop_during_imports(default_output_dir="outputs/run")

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from ddp_accel import (
    ArgumentParser,
    Callback,
    Optimizers,
    Run,
    RunRecord,
    ShardManifest,
    ShardReader,
    SparseAdamW,
    StopSignals,
    Task,
    TrainConfig,
    WindowShuffle,
    add_training_args,
    classification_metrics,
    classification_names,
    classification_values,
    make_identity,
    make_optimizer,
    run_main,
)


class ComplexLinear(torch.nn.Module):
    """y = x W^T + b with complex weights: the parameters DDP must all-reduce as complex numbers."""

    def __init__(self, inputs: int, outputs: int, dtype: torch.dtype = torch.complex64):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(outputs, inputs, dtype=dtype, generator=generator) / inputs**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(outputs, dtype=dtype))

    def forward(self, x):
        return x.to(self.weight.dtype) @ self.weight.T + self.bias


class QuantizedBag(torch.nn.Module):
    """Each of the 8 inputs quantised to one of 64 rows of its own in an EmbeddingBag (sparse gradients if asked)."""

    def __init__(self, hidden: int, sparse: bool):
        super().__init__()
        self.table = torch.nn.EmbeddingBag(8 * 64, hidden, mode="mean", sparse=sparse)

    def forward(self, x):
        return self.table(((x * 8).round().long() + 32).clamp(0, 63) + torch.arange(8, device=x.device) * 64)


class Magnitude(torch.nn.Module):
    def forward(self, z):
        return z.abs().float()


class IdDataset(Dataset):
    def __init__(self, size: int, seed: int, hang_at: int | None = None, hang_marker: Path | None = None):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = (self.x.sum(dim=1) > 0).long()
        self.hang_at, self.hang_marker = hang_at, hang_marker

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        hang_once(index, self.hang_at, self.hang_marker)
        return index, self.x[index], self.y[index]


def hang_once(index: int, hang_at: int | None, marker: Path | None) -> None:
    """Reading sample `hang_at` blocks forever, the first time in this output dir (`marker`): the rerun gets past."""
    if index == hang_at and marker is not None and not marker.exists():
        marker.touch()
        threading.Event().wait()  # a loader stuck for good (a dead network file system, a deadlock)


class ShardedIds(Dataset):
    """IdDataset's samples read in place from jsonl shards (`write_id_shards`), as a streamed data set is."""

    def __init__(self, folder: str, hang_at: int | None = None, hang_marker: Path | None = None):
        self.manifest = ShardManifest.of(Path(folder), (".jsonl",))
        self.reader = ShardReader(self.manifest)
        self.hang_at, self.hang_marker = hang_at, hang_marker

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, index):
        hang_once(index, self.hang_at, self.hang_marker)  # a shard's read that never returns
        _, _, row = self.reader.read(index)
        return index, torch.tensor(row["x"]), torch.tensor(row["y"])


def write_id_shards(folder: Path, size: int, per_shard: int) -> None:
    samples = IdDataset(size, seed=1)
    folder.mkdir(parents=True)
    for first in range(0, size, per_shard):
        rows = [
            {"x": samples.x[i].tolist(), "y": int(samples.y[i])} for i in range(first, min(size, first + per_shard))
        ]
        (folder / f"{first // per_shard:06d}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    ShardManifest.scanned(folder, sorted(path.name for path in folder.glob("*.jsonl"))).write()


class CrashAt(Callback):
    """A bug that strikes inside the same step every time (in its forward, before its update: no rank completes
    it, so a restart reaches it again)."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank, self.steps_done = step, rank, 0

    def on_start(self, run) -> None:
        self.steps_done = run.state.step

    def on_step_end(self, run) -> None:
        self.steps_done = run.state.step

    def check(self, process_index: int) -> None:
        if self.steps_done + 1 == self.step and process_index == self.rank:
            raise RuntimeError(f"probe: a bug at step {self.step}")


class LearningRates(Callback):
    """(samples trained, the learning rate of the next step) after every optimizer step, in lr_rank{R}.json."""

    def __init__(self, output_dir: str):
        self.output_dir, self.rates = output_dir, []

    def on_step_end(self, run) -> None:
        self.rates.append([run.state.samples_trained, run.optimizer.param_groups[0]["lr"]])

    def on_close(self, run) -> None:
        if self.rates:  # (a run refused before its first step leaves the output dir as it was)
            with contextlib.suppress(OSError):  # (a full disk: the run's own line says so)
                Path(self.output_dir, f"lr_rank{run.accelerator.process_index}.json").write_text(json.dumps(self.rates))


def main(signals: StopSignals | None = None) -> None:
    parser = add_training_args(ArgumentParser())
    parser.add_argument("--train-size", type=int, default=64)
    parser.add_argument("--val-size", type=int, default=23)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d after the first layer (buffers)")
    parser.add_argument("--step-ms", type=float, default=0, help="stand-in for a real step's compute time")
    parser.add_argument(
        "--complex", nargs="?", const="complex64", choices=["complex64", "complex128"], help="a complex layer"
    )
    parser.add_argument(
        "--sparse-embedding",
        action="store_true",
        help="an EmbeddingBag with sparse gradients first (SparseAdamW + AdamW as one optimizer)",
    )
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (training and evaluation)")
    parser.add_argument("--persistent-workers", action="store_true", help="keep the workers across epochs")
    parser.add_argument("--eval-ms", type=float, default=0, help="a slow evaluation batch: makes the phase easy to hit")
    parser.add_argument("--test-size", type=int, default=0, help="a test set evaluated once at the end")
    parser.add_argument("--hang-at-sample", type=int, help="reading this training sample blocks forever, once")
    parser.add_argument("--linger-s", type=float, default=0, help="stay this long after training (a signal may come)")
    parser.set_defaults(optimizer="adamw", weight_decay=0.01)  # torch's AdamW defaults
    parser.add_argument("--oom-above", type=int, help="a batch of more samples fails as out of memory does")
    parser.add_argument("--pid-dir", help="each process writes rank<R>.<pid> here at start (the fault tests' target)")
    parser.add_argument("--crash-at-step", type=int, help="rank 1 (or the only one) raises inside this step: a bug")
    parser.add_argument("--shards", help="training samples read in place from this folder's jsonl shards")
    parser.add_argument(
        "--sigterm-at-batch", type=int, help="rank 0 sends itself SIGTERM while computing its Nth batch (a preemption)"
    )
    args = parser.parse_args()
    config = TrainConfig.from_args(args)
    run = Run(config, signals)
    accelerator = run.accelerator

    layers: list[torch.nn.Module] = [QuantizedBag(args.hidden, sparse=True)] if args.sparse_embedding else []
    if args.complex:  # after the table when both are asked: one job proves both all-reduces
        layers.append(ComplexLinear(args.hidden if layers else 8, args.hidden, getattr(torch, args.complex)))
    layers = layers or [torch.nn.Linear(8, args.hidden)]
    layers += [torch.nn.BatchNorm1d(args.hidden)] if args.batchnorm else []
    activation = Magnitude() if args.complex else torch.nn.ReLU()
    model = torch.nn.Sequential(*layers, activation, torch.nn.Dropout(args.dropout), torch.nn.Linear(args.hidden, 2))
    if args.sparse_embedding:
        table = model[0].table.weight
        optimizer = Optimizers(
            SparseAdamW([table], lr=config.lr, weight_decay=0.1),
            torch.optim.AdamW([p for p in model.parameters() if p is not table], lr=config.lr),
        )
    else:
        optimizer = make_optimizer(model.parameters(), config)

    def loader(size: int, seed: int, shuffle: bool = False) -> DataLoader:
        hang = (args.hang_at_sample, Path(config.output_dir) / "hung_once") if shuffle else (None, None)
        return DataLoader(
            IdDataset(size, seed, *hang),
            batch_size=config.batch_size,
            shuffle=shuffle,
            num_workers=args.workers,
            persistent_workers=args.persistent_workers and args.workers > 0,
        )

    train, val = loader(args.train_size, 1, shuffle=True), loader(args.val_size, 2)
    if args.shards:  # in the shards' canonical order (ddp_accel.streaming), windows of 24 samples
        shards = ShardedIds(args.shards, args.hang_at_sample, Path(config.output_dir) / "hung_once")
        order = WindowShuffle(shards.manifest.counts, config.seed, window=24)
        train = DataLoader(shards, batch_size=config.batch_size, sampler=order, num_workers=args.workers)
    test = loader(args.test_size, 3) if args.test_size else None
    seen: list[list[int]] = []
    crash = [CrashAt(args.crash_at_step, min(1, accelerator.num_processes - 1))] if args.crash_at_step else []

    def loss_fn(model, batch):
        ids, x, y = batch
        if args.oom_above and len(ids) > args.oom_above:  # what a GPU says when the batch does not fit
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (probe --oom-above)")
        for bug in crash:
            bug.check(accelerator.process_index)
        seen.append(ids.tolist())
        if len(seen) == args.sigterm_at_batch and accelerator.is_main_process:
            os.kill(os.getpid(), signal.SIGTERM)
        output = model(x)  # DDP's buffer broadcast, then the BatchNorm statistics' update
        time.sleep(args.step_ms / 1000)  # a peer lost now is met by the backward's all-reduce
        return torch.nn.functional.cross_entropy(output, y)

    def eval_fn(model, batch):
        ids, x, y = batch
        time.sleep(args.eval_ms / 1000)
        return {"id": ids, **classification_values(model(x), y)}

    def metrics_fn(outputs):
        ids = outputs.pop("id").tolist()
        return {**classification_metrics(outputs), "id_sum": sum(ids), "unique_ids": len(set(ids))}

    def warmup_then_decay(optimizer, total_steps, steps_per_epoch):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / 3) * (1 - step / (total_steps + 1))
        )

    task = Task(
        model,
        optimizer,
        train,
        loss_fn,
        eval_loader=val,
        eval_fn=eval_fn,
        metrics_fn=metrics_fn,
        test_loader=test,
        make_scheduler=warmup_then_decay,
        metric_names=(*classification_names(2), "id_sum", "unique_ids"),
    )
    if args.pid_dir:
        Path(args.pid_dir).mkdir(parents=True, exist_ok=True)
        Path(args.pid_dir, f"rank{accelerator.process_index}.{os.getpid()}").touch()
    shape = {"hidden": args.hidden, "complex": args.complex or False, "sparse_embedding": args.sparse_embedding}
    identity = make_identity(shape)  # (False without --complex: the identity checkpoints of af45933 hold)
    callbacks = [*crash, LearningRates(config.output_dir)]
    run.fit(task, RunRecord(identity=identity), callbacks)
    Path(config.output_dir, f"seen_rank{accelerator.process_index}.json").write_text(json.dumps(seen))
    # torch elastic's per-worker error files (ATTEMPT/LOCAL_RANK/error.json), the layout through which a worker
    # learns that another one failed (launch_environments.TorchElastic.peer_failed; tests/test_launchers.py checks it)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        attempt = Path(error_file).parent.parent
        layout = {"own": Path(error_file).parent.name, "workers": sorted(path.name for path in attempt.iterdir())}
        Path(config.output_dir, f"error_files_rank{accelerator.process_index}.json").write_text(json.dumps(layout))
    # where each rank ran (the SLURM tests check the machine ranks)
    print(
        f"probe rank {accelerator.process_index} machine_rank {os.environ.get('GROUP_RANK', 0)} "
        f"node {os.environ.get('SLURMD_NODENAME', '-')}",
        flush=True,
    )
    time.sleep(args.linger_s)


if __name__ == "__main__":
    run_main(main)
