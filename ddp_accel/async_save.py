"""Asynchronous checkpoints (`--async-checkpoint`): a save stages the state in memory and training goes on while a
background thread writes it.

Staging runs Accelerate's own `save_state` (so the checkpoint's files and layout are exactly a synchronous save's),
with its writes deferred: each object Accelerate (or ddp_accel) hands to `save`/`torch.save` is copied at once (its
tensors cloned into CPU memory) and written later, by the function that would have written it. The step pays for
the copies; the pickling and the file system are the writer's. `StagedWrites.bytes` is what the staging holds.

What completes a checkpoint (the list of its files, training_state.json, the rename of `.tmp_step_N` to `step_N`)
runs in the main process's writer once every rank's writer has left its marker in the folder, so `latest` never
names a checkpoint that is not whole, and a process killed mid-write leaves the previous checkpoint as `latest`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

MARKER = ".written_by_rank_{rank}"
FAILED = ".failed_on_rank_{rank}"


class StagingBuffers:
    """The CPU tensors a run's staged checkpoints are copied into, kept from one save to the next: a copy into
    memory that is already mapped runs at memory speed, where fresh allocations paid the kernel's page faults
    (0.6 s for 1.15 GB here, 2 GB/s). The next save stages only once the previous one is written."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.used = 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        index, self.used = self.used, self.used + 1
        if index < len(self.tensors):
            kept = self.tensors[index]
            if type(kept) is type(tensor) and kept.shape == tensor.shape and kept.dtype == tensor.dtype:
                return kept.copy_(tensor.detach())
        copied = tensor.detach().to("cpu", copy=True)
        self.tensors[index : index + 1] = [copied]
        return copied


class StagedWrites:
    """Writes deferred during a save: (the writing function, a copy of the object, its arguments)."""

    def __init__(self, buffers: StagingBuffers | None = None) -> None:
        self.writes: list[tuple[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]]] = []
        self.bytes = 0
        self.buffers = buffers or StagingBuffers()
        self.buffers.used = 0
        # a source storage's address -> its staged copy, within the object being staged: tensors that share
        # storage (tied weights) share it staged too, so that Accelerate drops the duplicate name from
        # model.safetensors as it does in a synchronous save. Only within one object: the object holds its
        # tensors alive, where an address of an object staged before may already hold another tensor (FSDP's
        # full state dicts are gathered, staged and freed one after another)
        self._storages: dict[int, torch.Tensor] = {}

    def add(self, write: Callable[..., Any], obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._storages = {}
        self.writes.append((write, self._copied(obj), args, kwargs))

    def _copied(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copied_tensor(obj)
        if isinstance(obj, dict):  # its own type and attributes kept (an OrderedDict's _metadata, a defaultdict's)
            copied = copy.copy(obj)
            for key, value in obj.items():
                copied[key] = self._copied(value)
            return copied
        if isinstance(obj, list):
            return [self._copied(value) for value in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._copied(value) for value in obj)
        return copy.deepcopy(obj)

    def _copied_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if hasattr(tensor, "to_local"):  # a DTensor: this rank's shard is what is written
            local = tensor.to_local()
            self.bytes += local.numel() * local.element_size()
            return self.buffers.copy(tensor)
        storage = tensor.untyped_storage()
        staged = self._storages.get(storage.data_ptr()) if storage.nbytes() else None
        if staged is not None and staged.untyped_storage().nbytes() == storage.nbytes():  # a view of a staged one
            view = torch.empty(0, dtype=tensor.dtype)
            return view.set_(staged.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
        self.bytes += tensor.numel() * tensor.element_size()
        whole = tensor.storage_offset() == 0 and tensor.is_contiguous() and tensor.nbytes == storage.nbytes()
        copied = self.buffers.copy(tensor)
        if whole and storage.nbytes():
            self._storages[storage.data_ptr()] = copied
        return copied

    def write_all(self) -> None:
        for write, obj, args, kwargs in self.writes:
            write(obj, *args, **kwargs)


@contextlib.contextmanager
def deferred_writes(buffers: StagingBuffers | None = None, group: Any = None) -> Iterator[StagedWrites]:
    """Inside: Accelerate's checkpoint writes (`accelerate.checkpointing.save`, which writes weights, optimizer,
    scheduler and sampler), every `torch.save` (its RNG states, ddp_accel's own files) and, under FSDP, every
    `torch.distributed.checkpoint.save` (the shards of model and optimizer) are staged, not written. The shards are
    written later over `group`, a process group of the writers' own: torch.distributed.checkpoint plans a save with
    collectives, which must not mix with the training's. Only the thread that saves runs meanwhile: no other thread
    of ddp_accel writes with these then."""
    import accelerate.checkpointing as checkpointing
    import torch.distributed.checkpoint as dcp

    staged = StagedWrites(buffers)
    accelerate_save, torch_save, dcp_save = checkpointing.save, torch.save, dcp.save

    def staged_accelerate_save(obj: Any, *args: Any, **kwargs: Any) -> None:
        staged.add(accelerate_save, obj, args, kwargs)

    def staged_torch_save(obj: Any, *args: Any, **kwargs: Any) -> None:
        staged.add(torch_save, obj, args, kwargs)

    def staged_dcp_save(state_dict: Any, **kwargs: Any) -> None:
        if group is None:
            raise RuntimeError("a sharded checkpoint staged without the writers' process group")
        staged.add(dcp_save, state_dict, (), {**kwargs, "process_group": group})

    checkpointing.save, torch.save, dcp.save = staged_accelerate_save, staged_torch_save, staged_dcp_save
    try:
        yield staged
    finally:
        checkpointing.save, torch.save, dcp.save = accelerate_save, torch_save, dcp_save


class CheckpointWriter:
    """One background write at a time: `start` it, `wait` for it (its error is raised there, in the training
    thread)."""

    def __init__(self, sharded: bool = False) -> None:
        """`sharded` (FSDP): every rank makes, together, the process group its writes plan over."""
        import torch.distributed as dist

        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.buffers = StagingBuffers()  # its saves' staging memory, reused
        self.last_write_s = 0.0  # how long the last write took (with the staging: what a save at once costs)
        self.group = dist.new_group(backend="gloo") if sharded and dist.is_initialized() else None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, work: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            started = time.perf_counter()
            try:
                work()
            except BaseException as error:  # shown by wait(), in the training thread
                self._error = error
            self.last_write_s = time.perf_counter() - started

        self._thread = threading.Thread(target=run, name="ddp_accel-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def abandon(self, timeout_s: float) -> None:
        """A run that fails: the write in flight gets `timeout_s` to end (its error dropped), so that it does not
        write into a folder a later run owns, nor outlive the process group it writes over."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread, self._error = None, None


def leave_marker(folder: Path, rank: int, failed: bool = False) -> None:
    (folder / (FAILED if failed else MARKER).format(rank=rank)).touch()


def wait_for_markers(folder: Path, ranks: int, timeout_s: float) -> None:
    """Until every rank's writer left its marker in `folder` (then removed); an error when one failed (its
    failure marker) or after `timeout_s`."""
    markers = [folder / MARKER.format(rank=rank) for rank in range(ranks)]
    deadline = time.monotonic() + timeout_s
    while not all(marker.exists() for marker in markers):
        failed = sorted(folder.glob(FAILED.format(rank="*")))
        if failed:
            raise OSError(f"the checkpoint {folder.name} was not written: {failed[0].name}")
        if time.monotonic() > deadline:
            missing = [marker.name for marker in markers if not marker.exists()]
            raise TimeoutError(f"the checkpoint {folder.name} waited {timeout_s:.0f} s for {', '.join(missing)}")
        time.sleep(0.02)
    for marker in markers:
        marker.unlink()
