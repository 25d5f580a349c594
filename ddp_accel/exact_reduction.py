"""`--exact-micro-batch M`: the gradients of a step bitwise the same on any number of processes.

DDP sums each process's gradient in an order that depends on how many processes there are, and each process's
gradient is itself a sum over its own batch: 1 x 12 and 3 x 4 agree only within float rounding. Here every
process cuts its batch into pieces of M samples (the same pieces at any world size: the global batch's samples
in the order of the data), computes each piece's gradient alone (`no_sync`: no all-reduce), and the pieces'
gradients are added one at a time in the order of the global batch: a running total goes from rank to rank, each
adding its own pieces, and the last rank broadcasts it. A piece's dropout draws from a generator keyed by (seed,
step, piece), not by which process computes it. The cost: one forward and backward per M samples, a process's
pieces' gradients held until the step's end, and the world size's hops of one gradient, one after another, where
DDP's all-reduce overlaps the backward.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ddp_accel.errors import UserError
from ddp_accel.recovery import given_up, under_in_process_recovery

Tensors = Any  # a tensor, or a tuple, list or dict of them: a batch as a loader gives it
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
_piece_seed: ContextVar[int | None] = ContextVar("exact_piece_seed", default=None)


def refusal(accelerator: Accelerator, model: torch.nn.Module, micro_batch: int) -> str | None:
    """Why this run cannot keep its gradients exact across world sizes, in one line (None: it can)."""
    option = f"--exact-micro-batch {micro_batch}"
    if accelerator.distributed_type == DistributedType.XLA:
        return f"{option} sends gradients between processes with torch.distributed: not on XLA devices"
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return f"{option} adds whole gradients on every process: not under FSDP or DeepSpeed, whose shards are reduced"
    if accelerator.scaler is not None:
        return f"{option}: fp16's loss scale skips steps per process; use bf16 or fp32"
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats:
            return (
                f"{option}: {name or 'the model'} ({type(module).__name__}) keeps running statistics of each "
                "process's batches, which depend on the number of processes; use GroupNorm or LayerNorm, or drop "
                "the option"
            )
    return None


def pieces(batch: Tensors, size: int) -> list[Tensors]:
    """The batch cut into pieces of `size` samples along the first dimension of each tensor (the last piece may
    be shorter), in order."""
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, size))
    if isinstance(batch, dict):
        keys = list(batch)
        return [type(batch)(zip(keys, values, strict=True)) for values in side_by_side(batch.values(), size)]
    if isinstance(batch, (tuple, list)):
        rebuild = (lambda values: type(batch)(*values)) if hasattr(batch, "_fields") else type(batch)  # a namedtuple
        return [rebuild(values) for values in side_by_side(batch, size)]
    raise UserError(
        f"--exact-micro-batch cuts a batch into pieces: a tensor, or a tuple, list or dict of tensors; this loader "
        f"gives {type(batch).__name__}"
    )


def side_by_side(values: Any, size: int) -> list[tuple]:
    """The pieces of each value, zipped: one tuple a piece."""
    columns = [pieces(value, size) for value in values]
    if len({len(column) for column in columns}) > 1:
        raise UserError(
            "--exact-micro-batch cuts a batch's tensors alike: this batch's hold different numbers of samples"
        )
    return list(zip(*columns, strict=True))


def samples_in(batch: Tensors) -> int:
    """How many samples a batch holds: the first dimension of its first tensor."""
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(batch)


def piece_seed(seed: int, step: int, piece: int) -> int:
    """The seed of one piece's random draws (dropout): the same wherever the piece is computed."""
    digest = hashlib.blake2b(f"{seed}/{step}/{piece}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ProcessChain:
    """What the ordered sum sends between the processes (torch.distributed's default group). Under in-process
    recovery (ddp_accel.recovery) every wait watches the launcher's word, and a peer lost ends it at once: gloo does
    not always tell a process waiting on a peer that the peer is gone (a receive whose sender died mid-message, a
    broadcast from a peer that left), and it would wait until --timeout-s. A send and a receive are then each a
    broadcast within the pair's own group (a receive's wait cannot be watched: gloo's completes it only in wait)."""

    def __init__(self) -> None:
        self.pairs: dict[tuple[int, int], Any] = {}  # (rank, next rank) -> their group, under in-process recovery

    def send(self, tensor: torch.Tensor, rank: int) -> None:
        self.between(dist.get_rank(), rank, tensor)

    def receive(self, tensor: torch.Tensor, rank: int) -> None:
        self.between(rank, dist.get_rank(), tensor)

    def between(self, sender: int, receiver: int, tensor: torch.Tensor) -> None:
        if not under_in_process_recovery():
            dist.send(tensor, receiver) if sender == dist.get_rank() else dist.recv(tensor, sender)
            return
        if not self.pairs:  # every process makes every pair's group, in the same order (new_group's rule)
            world = dist.get_world_size()
            for first in range(world):
                pair = (min(first, (first + 1) % world), max(first, (first + 1) % world))
                if pair not in self.pairs and pair[0] != pair[1]:
                    self.pairs[pair] = dist.new_group(list(pair))
        group = self.pairs[(min(sender, receiver), max(sender, receiver))]
        wait_watching_the_launcher(dist.broadcast(tensor, sender, group=group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, rank: int) -> None:
        wait_watching_the_launcher(dist.broadcast(tensor, rank, async_op=True))

    def sum(self, count: int, device: torch.device) -> int:
        total = torch.tensor(count, dtype=torch.int64, device=device)
        wait_watching_the_launcher(dist.all_reduce(total, async_op=True))
        return int(total.item())


def wait_watching_the_launcher(work: Any, every_s: float = 0.1) -> None:
    """`work.wait()`; under in-process recovery, until it completes or the launcher says a peer was lost (its word,
    read every `every_s`): then a DistNetworkError, the lost peer's error (the survivor saves the step it reached)."""
    if not under_in_process_recovery():
        work.wait()
        return
    pause, read_at = 0.00005, time.monotonic() + every_s
    while not work.is_completed():
        if time.monotonic() >= read_at:
            if given_up():
                raise dist.DistNetworkError("a peer was lost (the launcher's word) while this process waited on it")
            read_at = time.monotonic() + every_s
        time.sleep(pause)
        pause = min(pause * 2, 0.002)  # (a long wait costs its process's core little; a short one, little latency)
    work.wait()


class ExactReduction:
    """The pieces of one optimizer step: `compute` each micro-batch piece by piece (its gradients kept, one row
    each), `reduce` at the step's end: the rows of every process added in the global batch's order, their mean
    written into the parameters' `.grad`."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        micro_batch: int,
        batch_size: int,
        seed: int,
        chain: ProcessChain | None = None,
    ):
        self.accelerator, self.model, self.micro_batch, self.seed = accelerator, model, micro_batch, seed
        self.chain = chain or ProcessChain()
        self.pieces_per_batch = -(-batch_size // micro_batch)
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.rows: list[torch.Tensor] = []  # one per piece: its gradient, flat (zeros for a batch's missing piece)
        self.counts: list[int] = []  # each row's samples

    def compute(self, batch: Tensors, loss_fn: LossFn, step: int) -> torch.Tensor:
        """Forward and backward of each piece of this process's micro-batch; the batch's mean loss."""
        accelerator = self.accelerator
        batch_index = len(self.rows) // self.pieces_per_batch  # within the step: the accumulation's micro-batch
        first = (batch_index * accelerator.num_processes + accelerator.process_index) * self.pieces_per_batch
        total, samples = torch.zeros(()), 0
        cut = pieces(batch, self.micro_batch)
        for offset in range(self.pieces_per_batch):
            if offset >= len(cut):
                self.keep(None, 0)
                continue
            piece, size = cut[offset], samples_in(cut[offset])
            with accelerator.no_sync(self.model), random_draws(piece_seed(self.seed, step, first + offset)):
                loss = loss_fn(self.model, piece)
                # a short piece weighs its samples: the step's gradient is the mean over all of them
                (loss * (size / self.micro_batch) if size != self.micro_batch else loss).backward()
            self.keep(loss, size)
            total, samples = total + loss.detach().float() * size, samples + size
        return total / samples

    def keep(self, loss: torch.Tensor | None, size: int) -> None:
        """This piece's gradients as one flat row; the parameters' `.grad` emptied for the next piece."""
        grads = []
        for parameter in self.parameters:
            grad = parameter.grad
            if grad is not None and grad.is_sparse:
                raise UserError("--exact-micro-batch adds dense gradients: this model's are sparse; drop the option")
            grad = torch.zeros_like(parameter) if grad is None or loss is None else grad
            grads.append((torch.view_as_real(grad) if grad.is_complex() else grad).reshape(-1))
            parameter.grad = None
        self.rows.append(torch.cat(grads))
        self.counts.append(size)

    def reduce(self) -> None:
        """Every process's rows added one at a time in the global batch's order (micro-batch, process, piece), the
        same sum at any world size: a running total passed from rank to rank, each adding its pieces of the
        micro-batch (pieces x parameters held per process, one total sent a hop); the last rank's total broadcast,
        divided by the samples' count in pieces and written into `.grad`."""
        processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        batches, per_batch = len(self.rows) // self.pieces_per_batch, self.pieces_per_batch
        total, count = torch.zeros_like(self.rows[0]), sum(self.counts)
        for batch in range(batches):
            if processes > 1 and (batch or rank):  # the global batch's pieces before this process's
                self.chain.receive(total, (rank - 1) % processes)
            for row in self.rows[batch * per_batch : (batch + 1) * per_batch]:
                total += row  # one addition at a time: no reduction kernel's own grouping
            if processes > 1 and (batch < batches - 1 or rank < processes - 1):
                self.chain.send(total, (rank + 1) % processes)
        if processes > 1:
            self.chain.broadcast(total, processes - 1)
            count = self.chain.sum(count, total.device)
        total /= count / self.micro_batch
        sizes = [parameter.numel() * (2 if parameter.is_complex() else 1) for parameter in self.parameters]
        for parameter, flat in zip(self.parameters, total.split(sizes), strict=True):
            if parameter.is_complex():
                parameter.grad = torch.view_as_complex(flat.view(*parameter.shape, 2)).clone()
            else:
                parameter.grad = flat.view(parameter.shape).clone()
        self.rows, self.counts = [], []


@contextmanager
def random_draws(seed: int) -> Iterator[None]:
    """The global generators (CPU, and this process's GPU) seeded for one piece, and restored after it."""
    token = _piece_seed.set(seed)
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            torch.manual_seed(seed)
            yield
    finally:
        _piece_seed.reset(token)


def piece_in_progress() -> int | None:
    """The seed of the --exact-micro-batch piece being computed, None outside one: a draw of a whole batch (MixUp's
    weight, CutMix's box) keys on it to be the same at any world size."""
    return _piece_seed.get()
