"""A preemption signal while a script is still importing (torch, accelerate, torchvision: seconds, and tens of
seconds on a loaded machine) ends it at once, with its marker.

Nothing is trained yet, so there is nothing to save: the process writes OUTPUT_DIR/preempted.json (phase
`startup`, `moment: imports`), says so on rank 0 and exits 0, as `run_main` does for a signal later in the start-up.
Blocking the signals until run_main could take over was not enough: under a launcher the whole job is killed
after its grace (torchrun: 30 s), and on a loaded node the imports outlasted it, leaving no marker at all.

Standard library only, and `import ddp_accel.startup` imports nothing else of the package (its front door is lazy;
a signal imports `ddp_accel.engines` to ask whether the launcher is ending the group for a failed peer):

    if __name__ == "__main__":
        from ddp_accel.startup import stop_during_imports

        stop_during_imports(default_output_dir="outputs/run")

`run_main` installs the process's own handlers when it starts; these are replaced then. The same guard pauses the
cyclic garbage collector for the imports: `run_main`'s first act (`imports_done`) freezes what they made, which lives
as long as the process, and turns it on again.

The same place says whether the command asks for DataLoader workers (`start_worker_server_early`): `run_main` then
forks their forkserver from the training process as its first act, with torch and the script already imported,
instead of a new interpreter importing them again while the first batch waits (about 3.5 s of CPU a process).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
MARKER = "preempted.json"  # ddp_accel.stopping.PREEMPTED_MARKER (not imported: that module imports torch)

WORKER_START_VARIABLE = "DDP_ACCEL_WORKER_START"
# the forkserver's environment is the training process's at its start: these tell ddp_accel.worker_server what to
# import; WORKER_SERVER_VARIABLE is set there, and tells the workers they came from it
FORKSERVER_MAIN_VARIABLE = "DDP_ACCEL_FORKSERVER_MAIN"
FORKSERVER_MAIN_MODULE_VARIABLE = "DDP_ACCEL_FORKSERVER_MAIN_MODULE"
FORKSERVER_SYS_PATH_VARIABLE = "DDP_ACCEL_FORKSERVER_SYS_PATH"
WORKER_SERVER_VARIABLE = "DDP_ACCEL_WORKER_SERVER"
WORKER_SERVER_MODULES = ["ddp_accel.worker_server", "torch"]  # what every forkserver imports first
PR_SET_PDEATHSIG = 1  # Linux prctl: a signal when the parent thread ends


def option_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    """The last value the command line gives one of `flags` (`--flag V`, `--flag=V`, and a short flag's `-jV`), as
    argparse will read it; None when none does."""
    found = None
    for index, arg in enumerate(argv):
        for flag in flags:
            if arg == flag and index + 1 < len(argv):
                found = argv[index + 1]
            elif arg.startswith(flag + "=") or (not flag.startswith("--") and arg.startswith(flag) and arg != flag):
                found = arg[len(flag) :].removeprefix("=")
    return found


def output_dir_of(argv: list[str], default: str) -> str:
    """--output-dir (or --output_dir) from the command line, as argparse will read it; else the script's default."""
    found = option_value(argv, ("--output-dir", "--output_dir"))
    return default if found is None else found


def stop_during_imports(default_output_dir: str) -> None:
    """Handle the preemption signals from now until run_main installs its own (SIGHUP only where not ignored:
    nohup), and pause the cyclic garbage collector until run_main starts (`imports_done`). Not in a thread other
    than the main one (Ray Train runs the script in one: its worker's main thread forwards the signals), where
    handlers cannot be installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    output_dir = output_dir_of(sys.argv[1:], default_output_dir)
    for signum in SIGNALS:
        if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        signal.signal(signum, lambda received, frame: stop_before_training(received, output_dir, "imports"))
    global _collector_paused
    if gc.isenabled():
        gc.disable()
        _collector_paused = True


# What a script imports (torch, accelerate, torchvision, datasets: about 200,000 objects) lives as long as the
# process; the cyclic collector walked all of it again each time it grew by a quarter, and every full collection
# of the training walked it once more: ~0.4 s of CPU a process (measured on template.py, 2.9 -> 2.5 s)
_collector_paused = False  # stop_during_imports turned the collector off; imports_done turns it on again


def imports_done() -> None:
    """The script's imports are done (run_main's first act; make_accelerator's, for a script without run_main): the
    cyclic garbage collector that stop_during_imports paused runs again, what the imports made frozen out of its
    sight. Nothing when it was not paused (a notebook, a test session, a thread of Ray Train)."""
    global _collector_paused
    if _collector_paused:
        _collector_paused = False
        gc.freeze()
        gc.enable()


def stop_before_training(signum: int, output_dir: str, moment: str) -> None:
    """A preemption signal before anything was trained: OUTPUT_DIR/preempted.json (phase `startup`, `moment`), one
    line on rank 0, exit 0 at once (from any thread). A signal from a launcher that is ending the group because
    another process failed is no preemption: exit at once, no marker and no line (the failed process's says why)."""
    if _ending_for_a_peer():
        end_forkserver()
        os._exit(128 + signum)
    name = signal.Signals(signum).name
    facts = {"phase": "startup", "signal": name, "step": None, "checkpoint": None, "moment": moment}
    try:
        folder = Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{MARKER}.{os.getpid()}"  # every rank writes the same facts: each its own, renamed
        partial.write_text(json.dumps({**facts, "time": time.time()}, indent=2))
        os.replace(partial, folder / MARKER)
    except OSError:  # an output dir that cannot be written: the run's own check says so at the next start
        pass
    end_forkserver()
    if os.environ.get("RANK", "0") in ("0", ""):
        print(
            f"preempted by {name} before training started: nothing to save; to start, run the same command with "
            "--resume-from-checkpoint latest",
            file=sys.stderr,
            flush=True,
        )
    os._exit(0)  # mid-import: nothing to clean up, and nothing half-imported must run


def _ending_for_a_peer() -> bool:
    """The engine's answer (engines.Engine.peer_failed), imported only now: a signal is rare, the guard's import cheap.
    A signal in the middle of the imports that module needs answers no, as before that answer existed."""
    try:
        from ddp_accel import engines

        return engines.current().peer_failed()
    except Exception:
        return False


def workers_asked(argv: Sequence[str], flags: Sequence[str], default: int) -> int:
    """The number of DataLoader workers the command line asks for through `flags` (`-j 4`, `-j4`, `--workers=4`),
    as argparse will read it; else `default`. A value that is not a number counts as none (argparse says why)."""
    found = option_value(argv, flags)
    found = str(default) if found is None else found
    return int(found) if found.isdigit() else 0


_worker_server_wanted = False  # the command asks for workers: run_main forks their forkserver before main() runs


def start_worker_server_early(flags: Sequence[str] = ("--workers",), default: int = 0) -> bool:
    """Have the forkserver that `ddp_accel.loaders` forks DataLoader workers from ready before the first batch, when
    the command line asks for workers: `run_main` forks it from the training process as its first act, once the
    script's imports are done (`start_wanted_worker_server`), so that it imports nothing again. True when asked. Not
    in a thread other than the main one (Ray Train's), nor when DDP_ACCEL_WORKER_START asks for another start
    method; a guess that turns out wrong costs a fork and nothing else: an unused server is ended at the exit."""
    global _worker_server_wanted
    if threading.current_thread() is not threading.main_thread() or forkserver_running():
        return False
    if os.environ.get(WORKER_START_VARIABLE, "forkserver").strip() not in ("", "forkserver"):
        return False
    if workers_asked(sys.argv[1:], flags, default) <= 0:
        return False
    _worker_server_wanted = True
    return True


def start_wanted_worker_server() -> None:
    """The forkserver `start_worker_server_early` asked for: forked from this process while it runs one thread of
    Python, else started as Python does (a new interpreter that imports torch and the script: seconds)."""
    global _worker_server_wanted
    if not _worker_server_wanted or forkserver_running():
        return
    _worker_server_wanted = False
    if not fork_forkserver():
        start_forkserver(WORKER_SERVER_MODULES)
    atexit.register(end_forkserver)  # a main that leaves by SystemExit (--help, argparse) skips run_main's end


def fork_forkserver() -> bool:
    """Start this process's forkserver as a fork of it: with everything this process imported (torch, the script,
    the dataset's modules) already there, it starts in milliseconds, where a new interpreter took about 3.5 s of CPU
    (on 2 cores and 2 ranks, four processes importing torch at once). Only while this process runs one thread of
    Python: a fork while another thread holds one of the interpreter's locks can hang the child (CPython gh-112275,
    Python < 3.11.7); run_main's start, after the imports and before the Accelerator, the progress bar or the
    watchdog start any, is such a moment. False (nothing started) otherwise, or off Linux."""
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    with signals_blocked():
        multiprocessing.resource_tracker.ensure_running()  # a small new interpreter of its own, as Python starts it
        multiprocessing.forkserver.set_forkserver_preload(["ddp_accel.worker_server"])
        spawn = multiprocessing.util.spawnv_passfds
        multiprocessing.util.spawnv_passfds = _run_in_a_fork  # what Python's forkserver starts, run in a fork
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            multiprocessing.util.spawnv_passfds = spawn
    return True


def _run_in_a_fork(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
    """`multiprocessing.util.spawnv_passfds`'s stand-in: the code a new interpreter would run (`-c CODE`: the
    forkserver's main loop), run by a fork of this process instead. Returns the child's pid."""
    flush_std_streams()  # a child that prints would otherwise print what is buffered here too
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        # forked inside ensure_running's `with self._lock`: a worker that starts a forkserver of its own needs it free
        multiprocessing.forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]
        _close_the_pipes_other_ends(passfds)
        exec(str(args[-1]), {"__name__": "__forkserver__"})  # noqa: S102  multiprocessing's own command
        code = 0
    except SystemExit as exit_:  # the end of its pipe: every client gone
        code = exit_.code if isinstance(exit_.code, int) else 0
    except BaseException:
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        os._exit(code)  # never back into the training process's frames or its atexit handlers


def _close_the_pipes_other_ends(passfds: Sequence[int]) -> None:
    """In the forked server: close the write ends of the pipes it was handed the read ends of (multiprocessing's
    'alive' pipe). A new interpreter never had them; this fork inherited them, and holding one, it would never see
    its training process go."""
    handed = {os.fstat(fd).st_ino for fd in passfds}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in passfds:
            continue
        with contextlib.suppress(OSError):
            info = os.fstat(fd)
            if info.st_ino in handed and stat.S_ISFIFO(info.st_mode):  # the other end of a handed pipe
                os.close(fd)


def flush_std_streams() -> None:
    """Write out what stdout and stderr hold, before a fork or an exit that skips Python's own flush."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


@contextlib.contextmanager
def signals_blocked() -> Generator[None, None, None]:
    """Blocks the preemption signals in this thread while a helper process (the forkserver, multiprocessing's
    resource tracker) is started: it inherits the mask through exec. A job-wide SIGUSR1 (SLURM's time-limit warning)
    would otherwise kill the resource tracker, whose successor then prints a `KeyError` traceback for each queue a
    loader releases, and the forkserver before it has blocked them itself. A signal sent meanwhile is delivered when
    this ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_forkserver(preload: list[str]) -> None:
    """Start this process's forkserver (and resource tracker), `preload` imported in it, and the training script
    with this process's `sys.path` (`ddp_accel.worker_server` reads them from its environment)."""
    multiprocessing.forkserver.set_forkserver_preload(preload)
    main = multiprocessing.spawn.get_preparation_data("ignore")
    start_with = {
        FORKSERVER_MAIN_VARIABLE: main.get("init_main_from_path", ""),
        FORKSERVER_MAIN_MODULE_VARIABLE: main.get("init_main_from_name", ""),
        FORKSERVER_SYS_PATH_VARIABLE: json.dumps(sys.path),
    }
    os.environ.update(start_with)
    try:
        with signals_blocked():
            multiprocessing.forkserver.ensure_running()
    finally:
        for name in start_with:
            os.environ.pop(name, None)


def forkserver_running() -> bool:
    server = multiprocessing.forkserver._forkserver
    return getattr(server, "_forkserver_pid", None) is not None


def end_forkserver() -> bool:
    """SIGKILL this process's forkserver and wait for it; False when none runs. Its workers have ended by then
    (`ddp_accel.loaders.end_worker_processes`) and it holds nothing to save: its own orderly exit, when its pipe
    closes, tears down torch's modules (about a second) while the command waits."""
    server = multiprocessing.forkserver._forkserver
    pid, alive_fd = getattr(server, "_forkserver_pid", None), getattr(server, "_forkserver_alive_fd", None)
    if pid is None:
        return False
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
    address = getattr(server, "_forkserver_address", None)
    if address and not multiprocessing.util.is_abstract_socket_namespace(address):  # a socket file
        with contextlib.suppress(OSError):
            os.unlink(address)
    # cleared, so that this process starts a new one when it needs one again
    for name in ("_forkserver_pid", "_forkserver_alive_fd", "_forkserver_address"):
        setattr(server, name, None)
    return True
