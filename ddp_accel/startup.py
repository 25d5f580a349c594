"""A preemption signal while a script is still importing (torch, accelerate, torchvision: seconds, and tens of
seconds on a loaded machine) ends it at once, with its marker.

Nothing is trained yet, so there is nothing to save: the process writes OUTPUT_DIR/preempted.json (phase
`startup`, `moment: imports`), says so on rank 0 and exits 0, as `run_main` does for a signal later in the start-up.
Blocking the signals until run_main could take over was not enough: under a launcher the whole job is killed
after its grace (torchrun: 30 s), and on a loaded node the imports outlasted it, leaving no marker at all.

Standard library only, and `import ddp_accel.startup` imports nothing else of the package (its front door is lazy):

    if __name__ == "__main__":
        from ddp_accel.startup import stop_during_imports

        stop_during_imports(default_output_dir="outputs/run")

`run_main` installs the process's own handlers when it starts; these are replaced then.

The same place starts the DataLoader workers' forkserver early (`start_worker_server_early`), when the command asks
for workers: its imports (torch, the script: seconds) then run beside the training process's own, on another core,
instead of after them while the first batch waits (about 3 s of every command on a 2-core machine).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing.forkserver
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from types import FrameType

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
    nohup). Not in a thread other than the main one (Ray Train runs the script in one: its worker's main thread
    forwards the signals), where handlers cannot be installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    output_dir = output_dir_of(sys.argv[1:], default_output_dir)
    for signum in SIGNALS:
        if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        signal.signal(signum, lambda received, frame: _stop(received, frame, output_dir))


def _stop(signum: int, frame: FrameType | None, output_dir: str) -> None:
    name = signal.Signals(signum).name
    facts = {"phase": "startup", "signal": name, "step": None, "checkpoint": None, "moment": "imports"}
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


def workers_asked(argv: Sequence[str], flags: Sequence[str], default: int) -> int:
    """The number of DataLoader workers the command line asks for through `flags` (`-j 4`, `-j4`, `--workers=4`),
    as argparse will read it; else `default`. A value that is not a number counts as none (argparse says why)."""
    found = option_value(argv, flags)
    found = str(default) if found is None else found
    return int(found) if found.isdigit() else 0


def start_worker_server_early(flags: Sequence[str] = ("--workers",), default: int = 0) -> bool:
    """Start the forkserver that `ddp_accel.loaders` forks DataLoader workers from now, at the start of the script,
    when its command line asks for workers: its imports run beside the script's own. True when started. Not in a
    thread other than the main one (Ray Train's), nor when DDP_ACCEL_WORKER_START asks for another start method; a
    guess that turns out wrong costs a background import and nothing else: the loaders start one when they need it,
    and an unused one is ended at the exit."""
    if threading.current_thread() is not threading.main_thread() or forkserver_running():
        return False
    if os.environ.get(WORKER_START_VARIABLE, "forkserver").strip() not in ("", "forkserver"):
        return False
    if workers_asked(sys.argv[1:], flags, default) <= 0:
        return False
    start_forkserver(WORKER_SERVER_MODULES)
    atexit.register(end_forkserver)  # an exit before run_main (--help, a wrong option): not left running
    return True


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
