"""The classic recipe, for comparison: torchrun + init_process_group + DistributedSampler + DDP + manual loop.

    torchrun --nproc_per_node 2 benchmarks/overhead_plain.py --steps 200
Prints one JSON line: {"loop": "plain", "samples_per_s": ...}.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from overhead_task import build_task
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--task", choices=["mlp", "resnet20"], default="mlp")
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    model, dataset, loss_fn = build_task(args.task, hidden=args.hidden)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0) if distributed else None
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None)
    model = DDP(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples, train_time = 0, 0.0
    first_step_at = last_step_at = None  # wall clock (benchmarks/startup.py): the command's start to its first step
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        tick = time.perf_counter()
        for batch in loader:
            loss = loss_fn(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            samples += len(batch[0]) * world
            last_step_at = time.time()
            first_step_at = first_step_at or last_step_at
        train_time += time.perf_counter() - tick
    if not distributed or dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "loop": "plain",
                    "world_size": world,
                    "samples_per_s": samples / train_time,
                    "first_step_at": first_step_at,
                    "last_step_at": last_step_at,
                }
            ),
            flush=True,
        )
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
