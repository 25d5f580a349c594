"""DataLoader iteration that survives a preemption signal sent to every process of a job.

SLURM (preemption, time limit, `scancel --signal`), torchrun and `accelerate launch` signal every process of a job,
DataLoader workers included. A worker killed by SIGTERM makes its parent raise `RuntimeError: DataLoader worker
(pid(s) ...) exited unexpectedly` from torch's SIGCHLD handler, wherever the parent is, which turns an orderly stop
into a crash. So the workers ignore the preemption signals (the parent decides when to stop), and every iterator is
shut down before the process exits: a worker that ignores SIGTERM would otherwise hang Python's exit, which
terminates daemonic children with SIGTERM and waits for them.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import signal
from collections.abc import Callable, Generator, Iterator
from typing import Any

from ddp_accel.stopping import PREEMPTION_SIGNALS


def _ignore_preemption(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    """A worker's first act: ignore the preemption signals, then unblock them (they were blocked across the fork,
    so a signal sent before this point waits, then is dropped)."""
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)
    if user_init is not None:
        user_init(worker_id)


def shield_workers(loader: Any) -> Any:
    """Make the workers `loader` starts ignore preemption signals (idempotent). Returns the loader."""
    for target in (loader, getattr(loader, "base_dataloader", None)):
        if target is None or getattr(target, "num_workers", 0) == 0:
            continue
        init = target.worker_init_fn
        if not (isinstance(init, functools.partial) and init.func is _ignore_preemption):
            target.worker_init_fn = functools.partial(_ignore_preemption, init)
    return loader


@contextlib.contextmanager
def batches(loader: Any) -> Iterator[Iterator[Any]]:
    """`for batch in batches:` over `loader`, its workers shielded; on any exit (the end, a break, an exception) the
    iterator is closed and the workers are shut down."""
    shield_workers(loader)
    iterating = _iterate(loader)
    try:
        yield iterating
    finally:
        iterating.close()
        shutdown_workers(loader)


def _iterate(loader: Any) -> Generator[Any, None, None]:
    """The workers are forked by `iter` (torch's DataLoader) or by the first `next` (Accelerate's loaders, which
    iterate in a generator): the preemption signals stay blocked across both, so that no worker can receive one
    before it ignores them."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        iterator = iter(loader)
        first = next(iterator, _END)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    try:
        if first is not _END:
            yield first
            yield from iterator
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:  # a generator: closing it drops the torch iterator inside, and its workers
            close()
        elif hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


_END = object()


def shutdown_workers(loader: Any) -> None:
    """Persistent workers outlive an epoch's iterator: shut them down too."""
    for target in (loader, getattr(loader, "base_dataloader", None)):
        persistent = getattr(target, "_iterator", None)
        if target is not None and persistent is not None and hasattr(persistent, "_shutdown_workers"):
            persistent._shutdown_workers()
            target._iterator = None


def kill_leftover_workers(timeout_s: float = 5.0) -> None:
    """Before the process exits: a daemonic child (a DataLoader worker) still alive is killed, not left to Python's
    exit, which would wait for it."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.join(timeout_s)
            if child.is_alive():
                child.kill()
                child.join(timeout_s)
