"""The same task through ddp_accel.fit (Accelerate): compare with overhead_plain.py.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml benchmarks/overhead_accel.py
Prints one JSON line: {"loop": "ddp_accel", "samples_per_s": ...}. It begins as scripts/template.py does (the
signals and the garbage collector during the imports), as a script of ours would.
"""

# as scripts/template.py: the preemption signals handled and the cyclic collector paused during the imports below
if __name__ == "__main__":
    from ddp_accel.startup import stop_during_imports

    stop_during_imports(default_output_dir="outputs/bench_overhead")

import json
import time

import torch
from overhead_task import build_task
from torch.utils.data import DataLoader

from ddp_accel import ArgumentParser, Callback, Run, Task, TrainConfig, add_training_args, run_main


class StepClock(Callback):
    """When the first and the last optimizer step ended (wall clock, for benchmarks/startup.py)."""

    def __init__(self) -> None:
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None

    def on_step_end(self, run) -> None:
        self.last_step_at = time.time()
        self.first_step_at = self.first_step_at or self.last_step_at


def main() -> None:
    parser = add_training_args(ArgumentParser())
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--task", choices=["mlp", "resnet20"], default="mlp")
    parser.set_defaults(output_dir="outputs/bench_overhead", epochs=2, batch_size=64, max_grad_norm=1.0, log_steps=50)
    args = parser.parse_args()
    config = TrainConfig.from_args(args)
    run = Run(config)
    accelerator = run.accelerator
    model, dataset, loss_fn = build_task(args.task, hidden=args.hidden)
    loader = DataLoader(dataset, batch_size=config.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clock = StepClock()
    metrics = run.fit(Task(model, optimizer, loader, loss_fn), callbacks=[clock])
    accelerator.print(
        json.dumps(
            {
                "loop": "ddp_accel",
                "world_size": accelerator.num_processes,
                "samples_per_s": metrics["train_samples_per_s"],
                "first_step_at": clock.first_step_at,
                "last_step_at": clock.last_step_at,
            }
        )
    )


if __name__ == "__main__":
    run_main(main)
