"""What a training function run by `notebook_launcher` (or `debug_launcher`) needs, in the kernel and in each worker
it forks: `launched` wraps the function. A process group inherited from the kernel is named as the cause; no worker
starts before the launcher forked them all (`wait_for_the_other_forks`); a stop signal that reaches the kernel while
its launcher forks a worker is not lost (`hold_stop_signals_during_forks`); the function ends with the distributed
shutdown `run_main` does for scripts."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_accel.elastic import START_TIME, child_processes, stat_fields
from ddp_accel.endings import shutdown
from ddp_accel.errors import UserError

INHERITED_GROUP = (
    "torch.distributed was initialised in the notebook's kernel before this launch (a cell made an Accelerator or "
    "called init_process_group), and the launched processes inherited its process group. Restart the kernel, and "
    "make the Accelerator inside the training function only"
)


def check_no_inherited_process_group() -> None:
    """A process group that exists before this process made one was forked from a notebook's kernel: using it
    (or destroying it) aborts the worker (`terminate called ... std::system_error`, exit -6)."""
    if not dist.is_available() or not dist.is_initialized():
        return
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and "TORCHELASTIC_RUN_ID" in os.environ and dist.get_world_size() != int(launched):
        raise UserError(INHERITED_GROUP)


# notebook_launcher's agent (torch elastic, in the kernel) forks the workers with its own handler of the stop signals
# installed, which raises SignalException (recognised by its module and name; another handler is left alone). A
# signal that arrives while a fork runs is handled inside an at-fork hook (logging's lock release), where CPython
# prints the exception as "ignored" and drops it: the stop button was lost and the training ran to its end. So while
# a fork runs that handler only records the signal, which is sent again once the fork is done, outside the hooks.
_handlers_during_fork: dict[int, Any] = {}
_signals_during_fork: list[int] = []


def _torch_elastic_signals() -> list[signal.Signals]:
    """The signals torch elastic's agent handles (its own variable, and its default)."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    return [getattr(signal, name.strip()) for name in names if isinstance(getattr(signal, name.strip(), None), int)]


def _raises_for_torch_elastic(handler: Any) -> bool:
    return (
        getattr(handler, "__module__", None) == "torch.distributed.elastic.multiprocessing.api"
        and getattr(handler, "__name__", None) == "_terminate_process_handler"
    )


def _record_a_signal_during_fork(signum: int, frame: Any) -> None:
    _signals_during_fork.append(signum)


def _hold_stop_signals_while_forking() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread handles signals: a fork from another thread drops none
    for signum in _torch_elastic_signals():
        handler = signal.getsignal(signum)
        if _raises_for_torch_elastic(handler):
            _handlers_during_fork[signum] = handler
            signal.signal(signum, _record_a_signal_during_fork)


def _restore_stop_handlers() -> None:
    for signum, handler in _handlers_during_fork.items():
        signal.signal(signum, handler)
    _handlers_during_fork.clear()


def _send_again_what_came_while_forking() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if _signals_during_fork:  # from another thread, a moment later: out of the hooks, where it would be dropped again
        threading.Timer(0.01, _send_recorded_signals, args=(os.getpid(),)).start()
    _restore_stop_handlers()  # last: the recorder still catches what comes while the thread starts


def _send_recorded_signals(pid: int) -> None:
    sent: set[int] = set()
    while _signals_during_fork:
        signum = _signals_during_fork.pop(0)
        if signum not in sent:
            sent.add(signum)
            os.kill(pid, signum)


def _forget_the_parents_signals() -> None:
    _restore_stop_handlers()  # the child's own handlers back; a signal the parent got is not the child's
    _signals_during_fork.clear()


@functools.cache  # once per process: at-fork hooks cannot be removed
def hold_stop_signals_during_forks() -> None:
    """In the process that runs notebook_launcher (the kernel), from the first `launched` function on."""
    os.register_at_fork(
        before=_hold_stop_signals_while_forking,
        after_in_parent=_send_again_what_came_while_forking,
        after_in_child=_forget_the_parents_signals,
    )


def _forks_since(parent: int, command: bytes, started: int) -> int:
    """Live children of `parent` that run `command` (forks of it: a fork keeps its parent's command line) and
    started no earlier than `started` (not a kernel's earlier children)."""
    return sum(
        fields[0] != "Z" and int(fields[START_TIME]) >= started and own == command
        for fields, own in child_processes(parent)
    )


def wait_for_the_other_forks(local_rank: int, local_world_size: int, timeout_s: float = 30.0) -> bool:
    """A worker forked by a launcher that runs in its own process (notebook_launcher: torch elastic's agent in the
    kernel) waits, before any network work, until the launcher has forked the workers after it (torch forks local
    ranks in order: rank r waits for `local_world_size - r` forks, itself included, that started no earlier).

    The agent's store server thread, in the kernel, looks up the name of every worker that connects
    (`getnameinfo`, which holds glibc's resolver lock). A worker forked at that moment inherits the lock held and
    hangs at its first name lookup, for good. No worker connecting before the last fork leaves no lookup to fork
    into.
    Returns whether this process waited (False: not a fork of its parent, or a lone worker); after `timeout_s`
    it says so and goes on."""
    if local_world_size <= 1:
        return False
    parent = os.getppid()
    try:
        command = Path("/proc/self/cmdline").read_bytes()
        if Path(f"/proc/{parent}/cmdline").read_bytes() != command:
            return False  # spawned or exec'd: a fresh process inherits no lock
        started = int(stat_fields("self")[START_TIME])
    except (OSError, ValueError, IndexError):
        return False
    deadline = time.monotonic() + timeout_s
    while _forks_since(parent, command, started) < local_world_size - local_rank:
        if time.monotonic() > deadline:
            print(
                f"warning: local rank {local_rank} waited {timeout_s:.0f} s for the launcher to fork the workers "
                f"after it (of {local_world_size}); starting without them",
                file=sys.stderr,
                flush=True,
            )
            break
        time.sleep(0.005)
    return True


def launched(function: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a training function for `notebook_launcher`/`debug_launcher`: it runs, its locals are released,
    then the distributed shutdown `run_main` does for scripts (no gloo teardown abort in the workers). A process
    group inherited from the kernel is named as the cause, not left to abort the worker; no worker starts before
    the launcher has forked them all (`wait_for_the_other_forks`); from here on, a stop signal that reaches this
    process while its launcher forks a worker is not lost (`hold_stop_signals_during_forks`)."""
    hold_stop_signals_during_forks()

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if dist.is_available() and dist.is_initialized() and "TORCHELASTIC_RUN_ID" in os.environ:
            raise UserError(INHERITED_GROUP)  # before any process group work: touching the kernel's aborts
        if "TORCHELASTIC_RUN_ID" in os.environ:  # notebook_launcher's agent runs in the kernel; debug_launcher none
            wait_for_the_other_forks(
                int(os.environ.get("LOCAL_RANK", "0") or 0), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
            )
        try:
            result = function(*args, **kwargs)
        except BaseException:
            shutdown(clean=False)
            raise
        shutdown(clean=True)
        return result

    return run
