"""A preemption signal while a script is still importing (torch, accelerate, torchvision: seconds, and tens of
seconds on a loaded machine) ends it at once, with its marker.

Nothing is trained yet, so there is nothing to save: the process writes OUTPUT_DIR/preempted.json (phase
`startup`, `moment: imports`), says so on rank 0 and exits 0, as `run_main` does for a signal later in the start-up.
Blocking the signals until run_main could take over was not enough: under a launcher the whole job is killed
after its grace (torchrun: 30 s), and on a loaded node the imports outlasted it, leaving no marker at all.

Standard library only, and `import ddp_accel.startup` imports nothing else of the package (its front door is lazy;
a signal imports `ddp_accel.launch_environments` to ask whether the launcher is ending the group for a failed peer):

    if __name__ == "__main__":
        from ddp_accel.startup import stop_during_imports

        stop_during_imports(default_output_dir="outputs/run")

`run_main` installs the process's own handlers when it starts; these are replaced then. The same guard pauses the
cyclic garbage collector for the imports: `run_main`'s first act (`imports_done`) freezes what they made, which lives
as long as the process, and turns it on again.

The same place starts the DataLoader workers' forkserver when the command asks for workers
(`start_worker_server_early`: Python's own, through its public `set_forkserver_preload` and `ensure_running`), so
that its imports of torch and of what the script imports run on another core beside the script's own, not while the
first batch waits.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import gc
import importlib.util
import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
MARKER = "preempted.json"  # ddp_accel.stopping.PREEMPTED_MARKER (not imported: that module imports torch)

WORKER_START_VARIABLE = "DDP_ACCEL_WORKER_START"
WORKER_SERVER_VARIABLE = "DDP_ACCEL_WORKER_SERVER"  # set in the forkserver (worker_server): its workers' parent
WORKER_SERVER_MODULES = ["ddp_accel.worker_server", "torch"]  # what every forkserver imports first
FORKSERVER_COMMAND = "from multiprocessing.forkserver import main"  # how Python starts its forkserver (-c)
PR_SET_PDEATHSIG = 1  # Linux prctl: a signal when the parent thread ends
TEXT_EXTRA = "pip install -e '.[text]' (Hugging Face datasets)"  # (`require`: what the text pipeline needs)


def require(packages: Sequence[str], install: str, who: str | None = None) -> None:
    """Before a script's imports: one line (exit 2) where a package that `who` (default: the script) needs beyond
    ddp-accel's own (an optional extra's) is not installed, and `install` says how to add it."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        print(f"error: {who or sys.argv[0]} needs {', '.join(missing)}: {install}", file=sys.stderr, flush=True)
        raise SystemExit(2)


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
# of the training walked it once more: ~0.4 s of CPU a process
_collector_paused = False  # stop_during_imports turned the collector off; imports_done turns it on again


def imports_done() -> None:
    """The script's imports are done (run_main's first act; make_accelerator's, for a script without run_main): the
    cyclic garbage collector that stop_during_imports paused runs again, what the imports made frozen out of its
    sight. Nothing when it was not paused (a notebook, a test session, a thread of Ray Train)."""
    global _collector_paused
    if _collector_paused:  # (once a process: the imports of a script that paused it)
        mark("imports")
        _collector_paused = False
        gc.freeze()
        gc.enable()


_moments: dict[str, float] = {}  # start-up moments this process reached (`mark`), by name: the time reached


def mark(moment: str) -> None:
    """This process's run reached `moment` of its start-up (a later run in the process marks it again):
    metrics.json's `startup_phases`."""
    _moments[moment] = time.time()


def startup_phases(first_batch_at: float, first_step_at: float) -> dict[str, float]:
    """Seconds from this process's start to each moment its run reached, in their order, then to its first batch and
    to its first step's end."""
    started = process_started_at()
    reached = sorted((at, moment) for moment, at in _moments.items() if at <= first_batch_at)
    phases = {moment: round(at - started, 3) for at, moment in reached}
    return phases | {"first_batch": round(first_batch_at - started, 3), "first_step": round(first_step_at - started, 3)}


def process_started_at() -> float:
    """When this process started, to the kernel's clock tick: its start since boot (/proc/self/stat) against the
    boot clock now. (psutil's create_time adds a boot time the kernel gives in whole seconds.)"""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return psutil.Process().create_time()


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
        write_marker(Path(output_dir), facts)
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


def write_marker(output_dir: Path, facts: Mapping[str, object]) -> None:
    """OUTPUT_DIR/preempted.json, the one writer of the marker (a job script requeues on it, the next run reads it):
    `facts` and the time, written aside and renamed (every rank may write the same facts: each its own file)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    partial = output_dir / f".{MARKER}.{os.getpid()}"
    partial.write_text(json.dumps({**facts, "time": time.time()}, indent=2))
    os.replace(partial, output_dir / MARKER)


def _ending_for_a_peer() -> bool:
    """The launch environment's answer (launch_environments.LaunchEnvironment.peer_failed), imported only now: a signal
    is rare, the guard's import cheap. A signal in the middle of the imports that module needs answers no, as before
    that answer existed."""
    try:
        from ddp_accel import launch_environments

        return launch_environments.current().peer_failed()
    except Exception:
        return False


def workers_asked(argv: Sequence[str], flags: Sequence[str], default: int) -> int:
    """The number of DataLoader workers the command line asks for through `flags` (`-j 4`, `-j4`, `--workers=4`),
    as argparse will read it; else `default`. A value that is not a number counts as none (argparse says why)."""
    found = option_value(argv, flags)
    found = str(default) if found is None else found
    return int(found) if found.isdigit() else 0


def start_worker_server_early(flags: Sequence[str] = ("--workers",), default: int = 0) -> bool:
    """Start the forkserver that `ddp_accel.loaders` forks DataLoader workers from now, when the command line asks
    for workers: it imports torch and what the script imports at its top level (`modules_imported_by`) on another
    core while the script imports the same, so that it is ready before the first batch and each worker's import of
    the script (as `__mp_main__`, as Python's forkserver has its workers do) finds them imported. True when started.
    Not in a thread other than the main one (Ray Train's), nor when DDP_ACCEL_WORKER_START asks for another start
    method; a guess that turns out wrong costs an idle process: an unused server is ended at the exit."""
    if threading.current_thread() is not threading.main_thread() or forkserver_running():
        return False
    if os.environ.get(WORKER_START_VARIABLE, "forkserver").strip() not in ("", "forkserver"):
        return False
    if workers_asked(sys.argv[1:], flags, default) <= 0:
        return False
    main_path = getattr(sys.modules.get("__main__"), "__file__", None)
    start_forkserver(WORKER_SERVER_MODULES + (modules_imported_by(Path(main_path)) if main_path else []))
    atexit.register(end_forkserver)  # a main that leaves by SystemExit (--help, argparse) skips run_main's end
    return True


def modules_imported_by(script: Path) -> list[str]:
    """The modules a script imports at its top level (`import a.b`, `from a.b import c`: `a.b`), in its order,
    read from its source without running it; none when it cannot be read."""
    try:
        tree = ast.parse(script.read_text(), str(script))
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [name for name in names if name != "__future__" and name not in found]
    return found


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


_forkserver_started = False  # start_forkserver ran in this process (and end_forkserver did not since)
_forkserver_ended = False  # end_forkserver reaped one: Python's own bookkeeping cannot start another in this process


def start_forkserver(preload: list[str]) -> None:
    """Start this process's forkserver (and multiprocessing's resource tracker), `preload` imported in it, with the
    preemption signals blocked (each inherits the mask through exec). Returns at once: the server imports while
    this process goes on, and the first worker asked of it waits until it is ready."""
    global _forkserver_started
    multiprocessing.forkserver.set_forkserver_preload(preload)
    with signals_blocked():
        multiprocessing.resource_tracker.ensure_running()
        multiprocessing.forkserver.ensure_running()
    _forkserver_started = True


def forkserver_running() -> bool:
    return _forkserver_started


def forkserver_available() -> bool:
    """False once this process ended its forkserver (at its end): later workers start another way."""
    return not _forkserver_ended


def end_forkserver() -> bool:
    """At the process's end: SIGKILL its forkserver (a child of it, found by its command line) and reap it, so that
    the command returns with nothing of it left; False when none runs. Its workers have ended by then
    (`ddp_accel.loaders.end_worker_processes`) and it holds nothing to save: its own orderly exit, when its pipe
    closes, tears down torch's modules (about a second) while the command waits."""
    global _forkserver_started, _forkserver_ended
    if not _forkserver_started:
        return False
    _forkserver_started, _forkserver_ended = False, True
    import psutil

    try:
        servers = [child for child in psutil.Process().children() if FORKSERVER_COMMAND in " ".join(child.cmdline())]
    except psutil.Error:
        return False
    for server in servers:
        with contextlib.suppress(psutil.Error):
            server.kill()
    psutil.wait_procs(servers, timeout=5)
    return bool(servers)
