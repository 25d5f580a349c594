"""While the process group forms: torch's env:// rendezvous (the launcher variables exported to each process by hand,
by srun tasks or a pod spec) blocks the main thread in C++ for up to --timeout-s (600 s by default). It says nothing,
and a Ctrl-C or a preemption signal is not acted on until it ends: Python runs a signal's handler only once the main
thread is back in Python.

`while_the_group_forms` puts a thread beside that wait. It says what the group waits for (the engine's
`waiting_line`: the address and port, whether rank 0 answers there), after FIRST_REPORT_S and then every REPORT_S,
and on a stop signal ends the process at once: nothing is trained yet, so a preemption signal leaves
preempted.json (phase `startup`, moment `rendezvous`) and exits 0, as during the imports, and Ctrl-C exits 130. The
signals reach the thread through Python's wakeup file descriptor, which the C-level handler writes even while the
main thread is blocked. Under a launcher's agent (torchrun, accelerate launch, Ray) the machines met before the
process started: nothing is added there.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

from ddp_accel import engines
from ddp_accel.startup import SIGNALS, end_forkserver, stop_before_training

FIRST_REPORT_S, REPORT_S = 10.0, 30.0


@contextlib.contextmanager
def while_the_group_forms(timeout_s: float, output_dir: str | None) -> Iterator[None]:
    """Inside: the process group forms (see the module's docstring)."""
    engine = engines.current()
    if not engine.forms_its_own_group or threading.current_thread() is not threading.main_thread():
        yield
        return
    woken, wake = socket.socketpair()  # signal numbers, written by Python's C-level handler
    formed, say_formed = socket.socketpair()
    for end in (woken, wake):
        end.setblocking(False)
    previous = signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
    watcher = threading.Thread(
        target=_watch, args=(engine, woken, formed, timeout_s, output_dir or "."), name="ddp_accel group", daemon=True
    )
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        say_formed.send(b"x")
        watcher.join()
        for end in (woken, wake, formed, say_formed):
            end.close()


def _watch(
    engine: engines.Engine, woken: socket.socket, formed: socket.socket, timeout_s: float, output_dir: str
) -> None:
    started = time.monotonic()
    report_at = started + FIRST_REPORT_S
    while True:
        ready, _, _ = select.select([woken, formed], [], [], max(0.0, report_at - time.monotonic()))
        if formed in ready:
            return
        if woken in ready:
            for signum in woken.recv(64):
                _stop(signum, output_dir)
            continue
        line = engine.waiting_line(time.monotonic() - started, timeout_s)
        if line:
            print(f"waiting: {line}", file=sys.stderr, flush=True)
        report_at = time.monotonic() + REPORT_S


def _stop(signum: int, output_dir: str) -> None:
    """End the process for a stop signal that arrived while the group formed (other signals: nothing to do)."""
    if signum in SIGNALS:
        stop_before_training(signum, output_dir, "rendezvous")
    if signum == signal.SIGINT:
        end_forkserver()
        print("\ninterrupted (Ctrl-C) while the process group formed: nothing trained yet", file=sys.stderr, flush=True)
        os._exit(130)
