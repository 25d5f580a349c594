"""DataLoader iteration that survives a preemption signal sent to every process of a job.

SLURM (preemption, time limit, `scancel --signal`), torchrun and `accelerate launch` signal every process of a job,
DataLoader workers included. A worker killed by SIGTERM makes its parent raise `RuntimeError: DataLoader worker
(pid(s) ...) exited unexpectedly` from torch's SIGCHLD handler, wherever the parent is, which turns an orderly stop
into a crash. So the workers ignore the preemption signals (the parent decides when to stop), and every iterator is
shut down before the process exits: a worker that ignores SIGTERM would otherwise hang Python's exit, which
terminates daemonic children with SIGTERM and waits for them.

Workers are not forked from the training process. A training process runs other threads (gloo, the progress bar,
the feeder threads of the previous epoch's worker queues, which may still be exiting), and a fork while another
thread holds one of the interpreter's own locks gives a child that hangs before it runs a line: CPython gh-112275,
fixed in 3.11.7 and 3.12, present in Debian 12's Python 3.11.2, where about one fork in a few thousand hangs and a
long job forks thousands of workers. So workers come from a `forkserver`: one single-threaded process per training
process, started once, that has imported torch and the dataset's modules and forks a worker on request (cheap: no
import per worker). In an interactive session (a notebook), where objects defined in `__main__` cannot be
re-imported by a forkserver's children, workers are forked as before. `DDP_ACCEL_WORKER_START=fork|spawn|forkserver`
overrides the choice; a loader created with its own `multiprocessing_context` keeps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import multiprocessing
import multiprocessing.context
import multiprocessing.reduction
import multiprocessing.resource_tracker
import multiprocessing.spawn
import os
import signal
import sys
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

from ddp_accel.errors import UserError
from ddp_accel.startup import (
    PR_SET_PDEATHSIG,
    WORKER_SERVER_MODULES,
    WORKER_SERVER_VARIABLE,
    WORKER_START_VARIABLE,
    end_forkserver,
    forkserver_available,
    forkserver_running,
    signals_blocked,
    start_forkserver,
)
from ddp_accel.stopping import PREEMPTION_SIGNALS

WORKER_START_METHODS = ("forkserver", "fork", "spawn")


def _ignore_preemption(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    """A worker's first act: ignore the preemption signals, then unblock them (the forkserver, or the fork's parent,
    had them blocked, so a signal sent before this point waits, then is dropped)."""
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)
    server = os.environ.get(WORKER_SERVER_VARIABLE)  # our forkserver's pid: this worker's parent
    if server and sys.platform.startswith("linux"):
        # die with the forkserver (which dies with the training process); one gone already: end now
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if server.isdigit() and os.getppid() != int(server):
            os._exit(0)
    # what the worker inherited stays out of garbage collections, which would copy every page of it
    gc.freeze()
    if server:  # our forkserver turned the collector off (worker_server)
        gc.enable()
    if user_init is not None:
        user_init(worker_id)


def shield_workers(loader: Any) -> Any:
    """Make the workers `loader` starts ignore preemption signals and come from a fork-safe start
    (`worker_context`), idempotent. Returns the loader."""
    for target in (loader, getattr(loader, "base_dataloader", None)):
        if target is None or getattr(target, "num_workers", 0) == 0:
            continue
        init = target.worker_init_fn
        if not (isinstance(init, functools.partial) and init.func is _ignore_preemption):
            target.worker_init_fn = functools.partial(_ignore_preemption, init)
        if target.multiprocessing_context is None:
            target.multiprocessing_context = worker_context(target)
    return loader


def worker_start_method() -> str:
    """forkserver, unless `__main__` cannot be imported again (an interactive session) or the variable says."""
    chosen = os.environ.get(WORKER_START_VARIABLE, "").strip()
    if chosen:
        if chosen not in WORKER_START_METHODS:
            raise UserError(
                f"{WORKER_START_VARIABLE}={chosen!r} is not a start method; use {', '.join(WORKER_START_METHODS)}"
            )
        return chosen
    main = sys.modules.get("__main__")
    interactive = getattr(main, "__file__", None) is None and getattr(main, "__spec__", None) is None
    return "fork" if interactive else "forkserver"


def worker_context(loader: Any) -> multiprocessing.context.BaseContext:
    """The context that starts `loader`'s workers; a forkserver is started here, once per process, with the
    preemption signals blocked in it (`ddp_accel.worker_server`) and the modules the workers need imported. What a
    forkserver's workers could not receive (a dataset that cannot be pickled, a class defined in a `python -m`
    package's `__main__`) is forked, with a warning, unless `DDP_ACCEL_WORKER_START` asked for the forkserver."""
    method = worker_start_method()
    if method == "forkserver" and not os.environ.get(WORKER_START_VARIABLE):
        refusal = _forkserver_refusal(loader)
        if refusal is not None:
            _warn_once(
                f"warning: DataLoader workers are forked from the training process: {refusal}. A fork can hang on "
                "Python older than 3.11.7 (CPython gh-112275); define the dataset and its functions at module level "
                "of an importable file to avoid it"
            )
            method = "fork"
    if method == "forkserver" and not forkserver_available():  # ended at this process's end: not again
        method = "spawn"
    if method == "forkserver" and not forkserver_running():
        start_forkserver(_modules_for(loader))
    elif method == "spawn":
        with signals_blocked():  # the tracker keeps the mask it starts with (it unblocks only SIGINT/TERM)
            multiprocessing.resource_tracker.ensure_running()
    return multiprocessing.get_context(method)


def _forkserver_refusal(loader: Any) -> str | None:
    """Why `loader`'s workers cannot come from a forkserver; None when they can."""
    things = _sent_to_workers(loader)
    main_name = multiprocessing.spawn.get_preparation_data("ignore").get("init_main_from_name", "")
    in_main = any(_module_of(thing) == "__main__" for thing in things)
    if in_main and main_name.endswith("__main__"):
        return f"the dataset or one of its functions is defined in {main_name}, which workers cannot import again"
    try:
        multiprocessing.reduction.ForkingPickler.dumps(things)
    except Exception as error:
        return f"the dataset or one of its functions cannot be pickled ({type(error).__name__}: {error})"
    return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned and os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    _warned.add(message)


def _sent_to_workers(loader: Any) -> tuple[Any, Any, Any]:
    """What each worker receives: the dataset, the collate function and the user's init function."""
    init = loader.worker_init_fn
    user_init = init.args[0] if isinstance(init, functools.partial) and init.func is _ignore_preemption else init
    return loader.dataset, loader.collate_fn, user_init


def _module_of(thing: Any) -> str:
    return getattr(thing, "__module__", None) or type(thing).__module__


def _modules_for(loader: Any) -> list[str]:
    """What a worker unpickles its dataset, collate and init functions from, imported once in the forkserver instead
    of in every worker (torch alone takes seconds)."""
    modules = list(WORKER_SERVER_MODULES)
    for thing in _sent_to_workers(loader):
        module = _module_of(thing)
        if module and module not in modules and module != "builtins" and not module.startswith("__"):
            modules.append(module)
    return modules


@contextlib.contextmanager
def batches(loader: Any) -> Iterator[Iterator[Any]]:
    """`for batch in batches:` over `loader`, its workers shielded; on any exit (the end, a break, an exception) the
    iterator is closed and the workers are shut down."""
    shield_workers(loader)
    running_before = set(multiprocessing.active_children())
    iterating = _iterate(loader)
    try:
        yield iterating
    finally:
        iterating.close()
        shutdown_workers(loader)
        # torch ends a worker that does not stop in time with SIGTERM, which ours ignore: a worker stuck in the
        # dataset would otherwise outlive its loader and hang the interpreter's exit
        leftovers = [child for child in set(multiprocessing.active_children()) - running_before if child.daemon]
        if leftovers:
            _kill_quietly(leftovers)


def _kill_quietly(workers: list[Any]) -> None:
    """SIGKILL `workers` without torch's SIGCHLD handler taking their deaths for a failure of a loader still
    registered (an iterator that an exception left behind: its own shutdown comes when it is collected)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if main_thread else None
    try:
        for worker in workers:
            worker.kill()
            worker.join(1)
    finally:
        if main_thread:
            signal.signal(signal.SIGCHLD, previous)


def _iterate(loader: Any) -> Generator[Any, None, None]:
    """The workers are forked by `iter` (torch's DataLoader) or by the first `next` (Accelerate's loaders, which
    iterate in a generator): the preemption signals stay blocked across both, so that no worker can receive one
    before it ignores them."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        iterator = iter(loader)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        raise
    try:
        try:
            first = next(iterator, _END)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if first is not _END:
            yield first
            yield from iterator
    finally:  # also when the first batch fails: its workers must not outlive it (they would hang the exit)
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


def end_worker_processes(timeout_s: float = 5.0) -> None:
    """Before the process exits, in order: the DataLoader workers still alive, then the forkserver they came from,
    each waited for. Left to the interpreter's exit, the forkserver ends only after the process has (by the
    parent-death signal): a command would return with it still in its process group. Multiprocessing's resource
    tracker is left to end by itself when this process's end closes its pipe (it unlinks what was left registered)."""
    kill_leftover_workers(timeout_s)
    end_forkserver()


def exit_now(code: int) -> None:
    """os._exit(code) once the workers and the forkserver are gone (the watchdog's exit: the training thread is
    stuck, so no orderly shutdown; a stuck worker is killed at once)."""
    with contextlib.suppress(Exception):
        end_worker_processes(timeout_s=0.5)
    os._exit(code)
