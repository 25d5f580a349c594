"""Trainer template: copy this file, replace the four marked methods with your model and data.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml scripts/template.py --epochs 10
    python scripts/template.py --epochs 3 --no-val

Train every epoch, validate every --eval-interval epochs, test once at the end. The training
loop itself (DDP, sharding, accumulation, clipping, checkpoint/resume, logging) is ddp_accel.fit;
validation and test use ddp_accel.evaluate, which counts every sample exactly once on any world size.
The built-in task: 3-class Gaussian blobs in 16 dimensions, an MLP with BatchNorm.
"""

from __future__ import annotations

# A preemption signal during the imports below ends the process at once with its marker (ddp_accel/startup.py);
# only when run as a script: a program that imports this module keeps its own signal handling
if __name__ == "__main__":
    from ddp_accel.startup import stop_during_imports

    stop_during_imports(default_output_dir="outputs/template")

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ddp_accel import (
    ArgumentParser,
    Run,
    RunRecord,
    StopSignals,
    Task,
    TrainConfig,
    add_training_args,
    classification_metrics,
    classification_names,
    classification_values,
    cli,
    convert_sync_batchnorm,
    make_optimizer,
    run_main,
)


class Trainer:
    def __init__(self, args, signals: StopSignals | None = None):
        self.args = args
        self.config = TrainConfig.from_args(args, eval_every_epochs=args.eval_interval)
        self.run = Run(self.config, signals)  # the output folder checked, then the Accelerator built
        self.accelerator = self.run.accelerator

    # --- 1. your data: three datasets (train is sharded across processes, val/test too for speed) ---
    def build_datasets(self) -> tuple[Dataset, Dataset, Dataset]:
        generator = torch.Generator().manual_seed(1234)  # the same data on every rank
        centers = torch.randn(3, 16, generator=generator) * 1.5
        labels = torch.randint(0, 3, (3000,), generator=generator)
        inputs = centers[labels] + torch.randn(3000, 16, generator=generator)
        data = TensorDataset(inputs, labels)
        return torch.utils.data.random_split(data, [2000, 500, 500], generator=generator)

    # --- 2. your model ---
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 3))

    # --- 3. the training loss of one batch ---
    def loss(self, model, batch) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs), labels)

    # --- 4. per-sample values for validation/test (gathered across ranks), and the metrics from them ---
    def eval_outputs(self, model, batch) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        return classification_values(model(inputs), labels)  # per-sample loss and accuracy (top-1)

    def metrics(self, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
        return classification_metrics(outputs)

    metric_names = classification_names(3)  # what `metrics` reports: --best-metric is checked before training

    # --- the run: usually nothing to change below ---
    def fit(self) -> dict[str, float]:
        args, accelerator = self.args, self.accelerator
        train_set, val_set, test_set = self.build_datasets()
        model = self.build_model()
        if args.sync_bn and accelerator.num_processes > 1:
            # BatchNorm statistics over the global batch instead of each process's share (small per-GPU batches)
            model, layers = convert_sync_batchnorm(model, accelerator.device)
            accelerator.print(f"SyncBatchNorm: {layers} layers converted")
        optimizer = make_optimizer(model.parameters(), self.config)

        def cosine(optimizer, total_steps, steps_per_epoch):
            return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

        def loader(data, shuffle):
            return DataLoader(data, batch_size=self.config.batch_size, shuffle=shuffle)

        task = Task(
            model,
            optimizer,
            loader(train_set, True),
            self.loss,
            eval_loader=None if args.no_val else loader(val_set, False),
            eval_fn=self.eval_outputs,
            metrics_fn=self.metrics,
            metric_names=self.metric_names,
            test_loader=loader(test_set, False),  # evaluated once, after training, before the results are written
            make_scheduler=cosine,
        )
        return self.run.fit(task, RunRecord(title="template"))


def main(signals: StopSignals) -> None:
    parser = add_training_args(ArgumentParser(description="Trainer template: train / validate / test"))
    parser.add_argument("--eval-interval", type=cli.positive_int, default=1, help="validate every N epochs")
    parser.add_argument("--no-val", action="store_true", help="skip validation (test still runs at the end)")
    parser.add_argument(
        "--sync-bn", action="store_true", help="SyncBatchNorm across processes (GPUs, and CPU processes over gloo)"
    )
    parser.set_defaults(output_dir="outputs/template", epochs=10, batch_size=256, lr=0.1, log_steps=10)
    parser.set_defaults(optimizer="sgd", momentum=0.9, weight_decay=1e-4)
    Trainer(parser.parse_args(), signals).fit()


if __name__ == "__main__":
    run_main(main)
