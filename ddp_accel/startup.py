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
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
MARKER = "preempted.json"  # ddp_accel.stopping.PREEMPTED_MARKER (not imported: that module imports torch)


def output_dir_of(argv: list[str], default: str) -> str:
    """--output-dir (or --output_dir) from the command line, as argparse will read it; else the script's default."""
    found = default
    for index, arg in enumerate(argv):
        for flag in ("--output-dir", "--output_dir"):
            if arg == flag and index + 1 < len(argv):
                found = argv[index + 1]
            elif arg.startswith(flag + "="):
                found = arg.split("=", 1)[1]
    return found


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
    if os.environ.get("RANK", "0") in ("0", ""):
        print(
            f"preempted by {name} before training started: nothing to save; to start, run the same command with "
            "--resume-from-checkpoint latest",
            file=sys.stderr,
            flush=True,
        )
    os._exit(0)  # mid-import: nothing to clean up, and nothing half-imported must run
