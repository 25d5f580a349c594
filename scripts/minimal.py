"""The smallest complete DDP program, on Accelerate.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml scripts/minimal.py
    torchrun --nproc_per_node 2 scripts/minimal.py

nn.Linear(10, 10) + MSE + SGD on random data, trained through ddp_accel.fit (which calls
accelerator.prepare: DDP wrap, sampler sharding, device placement). Then every rank reports
itself and the main process prints an all_gather_object of one dict per rank.
"""

# A preemption signal during the imports below ends the process at once with its marker (ddp_accel/startup.py);
# only when run as a script: a program that imports this module keeps its own signal handling
if __name__ == "__main__":
    from ddp_accel.startup import stop_during_imports

    stop_during_imports(default_output_dir="outputs/minimal")

import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader, TensorDataset

from ddp_accel import (
    ArgumentParser,
    Run,
    StopSignals,
    Task,
    TrainConfig,
    add_training_args,
    cli,
    make_optimizer,
    run_main,
)


def main(signals: StopSignals) -> None:
    parser = add_training_args(ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--samples", type=cli.positive_int, default=20, help="random (input, target) pairs")
    parser.set_defaults(output_dir="outputs/minimal", epochs=5, batch_size=4, lr=1e-3, log_steps=5)
    parser.set_defaults(optimizer="sgd", momentum=0.0, weight_decay=0.0)  # plain SGD
    args = parser.parse_args()
    config = TrainConfig.from_args(args)
    run = Run(config, signals)
    accelerator = run.accelerator

    data = torch.Generator().manual_seed(config.seed)
    dataset = TensorDataset(
        torch.randn(args.samples, 10, generator=data), torch.randn(args.samples, 10, generator=data)
    )
    model = torch.nn.Linear(10, 10)
    optimizer = make_optimizer(model.parameters(), config)
    loader = DataLoader(dataset, batch_size=config.batch_size, shuffle=True)

    def mse(model, batch):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(model(inputs), targets)

    def per_sample_mse(model, batch):
        inputs, targets = batch
        return {"mse": ((model(inputs) - targets) ** 2).mean(dim=1)}

    task = Task(
        model,
        optimizer,
        loader,
        mse,
        eval_loader=DataLoader(dataset, batch_size=config.batch_size),
        eval_fn=per_sample_mse,
    )
    metrics = run.fit(task)

    state = accelerator.state
    print(
        f"rank {state.process_index} local_rank {state.local_process_index} "
        f"world_size {state.num_processes} device {accelerator.device}",
        flush=True,
    )
    ranks = gather_object([{"rank": state.process_index, "final_mse": round(metrics["eval_mse"], 6)}])
    accelerator.print(f"all_gather_object: {ranks}")


if __name__ == "__main__":
    run_main(main)
