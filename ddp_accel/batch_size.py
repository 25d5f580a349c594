"""`--auto-batch-size`: the largest per-process batch that fits, the global batch kept by more accumulation.

The batch the user asked for (`--batch-size` per process, x processes x `--gradient-accumulation-steps`) is the
recipe; what fits in memory is the machine's business. Before training, one forward and backward pass of a
micro-batch is tried at `--batch-size`, then at each smaller divisor of it, until one fits on every rank
(accelerate's out-of-memory test, `should_reduce_batch_size`; the ranks agree on the smallest). Training then
runs micro-batches of that size and accumulates `batch_size / micro` times more, so each optimizer step sees the
same samples as the batch asked for. The trial changes nothing: the weights are not stepped, gradients are
cleared, and the buffers (BatchNorm's statistics) and random generators are put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from ddp_accel.errors import UserError


def divisors_from_largest(number: int) -> list[int]:
    return [size for size in range(number, 0, -1) if number % size == 0]


def find_micro_batch(accelerator: Any, model: torch.nn.Module, loss_fn: Any, loader: Any, batch_size: int) -> int:
    """The largest divisor of `batch_size` whose forward and backward pass fits on every rank."""
    if isinstance(loader.dataset, IterableDataset) or not hasattr(loader.dataset, "__len__"):
        raise UserError("--auto-batch-size tries batches of the training set by index: not with an iterable dataset")
    model.to(accelerator.device)
    for size in divisors_from_largest(min(batch_size, len(loader.dataset))):
        fits = _fits(accelerator, model, loss_fn, loader, size)
        if distributed():
            flag = torch.tensor(float(fits), device=accelerator.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # the same size on every rank
            fits = bool(flag.item())
        if fits:
            return size
    raise UserError(
        f"--auto-batch-size: not even a batch of 1 fits in memory on {accelerator.device} (a smaller model, "
        "--mixed-precision bf16, or a device with more memory)"
    )


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _fits(accelerator: Any, model: torch.nn.Module, loss_fn: Any, loader: Any, size: int) -> bool:
    batch = send_to_device(loader.collate_fn([loader.dataset[index] for index in range(size)]), accelerator.device)
    fits = False
    try:
        with buffers_and_generators_kept(model), accelerator.autocast():
            loss_fn(model, batch).backward()
        fits = True
    except Exception as error:
        if not should_reduce_batch_size(error):
            raise
    finally:
        del batch
        model.zero_grad(set_to_none=True)
        # a pass that ran out of memory can leave its activations in reference cycles (the error's frames): collected
        # before the next size; a pass that fit freed them as it returned (a full collection of a large process is slow)
        clear_device_cache(garbage_collection=not fits)
    return fits


@contextlib.contextmanager
def buffers_and_generators_kept(model: torch.nn.Module) -> Iterator[None]:
    """`model`'s buffers (BatchNorm's statistics) and torch's random generators come back as they were."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    buffer.copy_(buffers[name])


def with_batch_size(loader: DataLoader, batch_size: int) -> DataLoader:
    """`loader` again, with another batch size (its dataset, order, workers and collation kept)."""
    custom = type(loader.batch_sampler).__name__ != "BatchSampler" or type(loader.sampler).__name__ not in (
        "RandomSampler",
        "SequentialSampler",
    )
    if custom:
        raise UserError("--auto-batch-size rebuilds the training loader: not with a sampler of its own")
    return DataLoader(
        loader.dataset,
        batch_size=batch_size,
        shuffle=isinstance(loader.sampler, RandomSampler),
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
    )
