"""Asynchronous checkpoints (`--async-checkpoint`): at the step a save copies the state into memory, and a background
thread writes it while training goes on.

The files are the synchronous save's, listed once in ddp_accel.checkpoint_format (`write_checkpoint`): given
`StagedWrites` as their sink, each state is copied into CPU memory at the step, and the writer thread writes the
copies; FSDP's shards go to torch.distributed.checkpoint's `async_save` (it copies them itself), each over a process
group of its own so that its planning collectives never meet the training's. The step pays for the copies; the
pickling and the file system are the writer's. `StagedWrites.bytes` is what the copies hold.

What completes a checkpoint (the list of its files, training_state.json, the rename of `.tmp_step_N` to `step_N`)
runs in the main process's writer once every rank's writer has left its marker in the folder (`write_then_mark`),
so `latest` never names a checkpoint that is not whole, and a process killed mid-write leaves the previous
checkpoint as `latest`.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

MARKER = ".written_by_rank_{rank}"
FAILED = ".failed_on_rank_{rank}"

Write = Callable[[Any, Path], None]  # (an object, its file): writes it


class StagingBuffers:
    """The CPU tensors a run's staged checkpoints are copied into, kept from one save to the next: a copy into
    memory that is already mapped runs at memory speed, where fresh allocations pay the kernel's page faults.
    The next save stages only once the previous one is written."""

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
    """The writes of one checkpoint, for the writer thread: (the writing function, a copy of the object, its file),
    and the futures of torch.distributed.checkpoint's own asynchronous saves."""

    def __init__(self, buffers: StagingBuffers | None = None) -> None:
        self.writes: list[tuple[Write, Any, Path]] = []
        self.futures: list[Future[Any]] = []
        self.bytes = 0
        self.buffers = buffers or StagingBuffers()
        self.buffers.used = 0
        # a source storage's address -> its staged copy, within the object being staged: tensors that share
        # storage (tied weights) share it staged too, so that Accelerate drops the duplicate name from
        # model.safetensors as it does in a synchronous save. Only within one object: the object holds its
        # tensors alive, where an address of an object staged before may already hold another tensor (FSDP's
        # full state dicts are gathered, staged and freed one after another)
        self._storages: dict[int, torch.Tensor] = {}

    def add(self, write: Write, obj: Any, path: Path) -> None:
        self._storages = {}
        self.writes.append((write, self._copied(obj), path))

    def add_sharded(self, state: dict[str, Any], folder: Path, group: Any) -> None:
        """FSDP's shards, by torch.distributed.checkpoint's `async_save` (it copies them itself), over `group`: a
        process group of the writer's own, so that its planning collectives never meet the training's."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        folder.mkdir(parents=True, exist_ok=True)
        writer = dcp.FileSystemWriter(str(folder))
        saving: Any = dcp.async_save(state, storage_writer=writer, planner=DefaultSavePlanner(), process_group=group)
        self.futures.append(getattr(saving, "upload_completion", saving))  # (newer torch may answer with both)

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
        """Every write; the first failure is raised once torch's own writes have all ended (a write still running
        would put files back into a folder the failure's cleanup removed)."""
        failures = []
        for future in self.futures:
            try:
                future.result()
            except BaseException as error:
                failures.append(error)
        if failures:
            raise failures[0]
        for write, obj, path in self.writes:
            write(obj, path)


class CheckpointWriter:
    """One background write at a time: `start` it, `wait` for it (its error is raised there, in the training
    thread)."""

    def __init__(self, sharded: bool = False) -> None:
        """`sharded` (FSDP): every rank makes, together, the process groups its sharded saves plan over (one for
        the model's state, one for the optimizer's: their saves run at the same time)."""
        import torch.distributed as dist

        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.buffers = StagingBuffers()  # its saves' staging memory, reused
        self.last_write_s = 0.0  # how long the last write took (with the staging: what a save at once costs)
        self.groups = [dist.new_group(backend="gloo") for _ in range(2)] if sharded and dist.is_initialized() else []

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


ASYNC_WRITE_TIMEOUT_S = 3600.0  # the main process's writer waits this long for the other ranks' files


def write_then_mark(
    staged: StagedWrites, folder: Path, rank: int, ranks: int, complete: Callable[[], None] | None
) -> None:
    """A rank's writer: its files, then its marker; with `complete` (the main process's writer), then every rank's
    marker, then `complete` (the list of the folder's files, training_state.json, the rename). The order is the
    checkpoint's whole guarantee: the main process reads a marker as "this rank's files are written", lists the
    folder and renames it; a marker left before the files would let it rename a folder another rank still writes
    into, and list a checkpoint without that rank's files."""
    staged.write_all()
    leave_marker(folder, rank)
    if complete is not None:
        wait_for_markers(folder, ranks, timeout_s=ASYNC_WRITE_TIMEOUT_S)
        complete()


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
