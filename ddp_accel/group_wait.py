"""While the process group forms: torch's env:// rendezvous (the launcher variables exported to each process by hand,
by srun tasks or a pod spec) blocks the main thread in C++ for up to --timeout-s (600 s by default). It says nothing,
and a Ctrl-C or a preemption signal is not acted on until it ends: Python runs a signal's handler only once the main
thread is back in Python.

`while_the_group_forms` puts a thread beside that wait. It says what the group waits for (the launch environment's
`waiting_line`: the address and port, whether rank 0 answers there), after FIRST_REPORT_S (or half the timeout,
when shorter) and then every REPORT_S. The timeout is the bound. A rank other than 0 first waits, in Python, until
rank 0's store answers at MASTER_ADDR:MASTER_PORT (`until_it_answers`; at --timeout-s the line that the group did
not form, the launch environment's `never_formed_line`, as a UserError): torch's own client would try twice the timeout
and print some 60 lines of C++ frames at its first failed connect. Then torch's rendezvous: a timeout error of its is
the same line, and where it still waits at --timeout-s plus BOUND_GRACE_S the thread says that line and ends the
process with exit 2.

On a stop signal the thread ends the process at once: nothing is trained yet, so a preemption signal leaves
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

from ddp_accel import launch_environments
from ddp_accel.errors import UserError
from ddp_accel.startup import SIGNALS, end_forkserver, stop_before_training

FIRST_REPORT_S, REPORT_S = 10.0, 30.0
BOUND_GRACE_S = 2.0  # past --timeout-s, the process ends whatever torch's rendezvous still waits for
NEVER_FORMED_EXIT_CODE = 2  # as a user error: what to change is in the line


@contextlib.contextmanager
def while_the_group_forms(timeout_s: float, output_dir: str | None) -> Iterator[None]:
    """Inside: the process group forms (see the module's docstring)."""
    environment = launch_environments.current()
    if not environment.forms_its_own_group or threading.current_thread() is not threading.main_thread():
        yield
        return
    woken, wake = socket.socketpair()  # signal numbers, written by Python's C-level handler
    formed, say_formed = socket.socketpair()
    for end in (woken, wake):
        end.setblocking(False)
    previous = signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
    started = time.monotonic()  # here: the thread may first run once torch's wait has begun
    watch = _Watch(environment, woken, formed, started, timeout_s, output_dir or ".")
    watcher = threading.Thread(target=watch.run, name="ddp_accel group", daemon=True)
    watcher.start()
    try:
        with watch.acting_on_signals():
            store = environment.store_to_reach()
            if store is not None:  # rank 0's store first, in Python: torch's failed connect prints pages of C++ frames
                until_it_answers(store, started + timeout_s, environment.never_formed_line(timeout_s))
            yield
    except Exception as error:
        if _timed_out(error, time.monotonic() - started, timeout_s):
            raise UserError(environment.never_formed_line(timeout_s), every_process=True) from None
        raise
    finally:
        signal.set_wakeup_fd(previous)
        say_formed.send(b"x")
        watcher.join()
        for end in (woken, wake, formed, say_formed):
            end.close()


def until_it_answers(store: tuple[str, int], deadline: float, never_formed: str) -> None:
    """Until something accepts a connection at `store` (a UserError saying `never_formed` at `deadline`)."""
    while not launch_environments.answers(*store, timeout=min(1.0, max(0.05, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise UserError(never_formed, every_process=True)
        time.sleep(0.1)


def _timed_out(error: Exception, waited_s: float, timeout_s: float) -> bool:
    """torch's rendezvous gave up for the timeout (its store's connect or wait), not for another reason."""
    message = str(error).lower()
    return waited_s >= 0.9 * timeout_s and ("timed out" in message or "timeout" in message or "connect" in message)


class _Watch:
    """The thread beside the wait, and the one actor on a stop signal until the group formed: the main thread's
    handlers do nothing meanwhile (else a signal between two C++ calls was acted on twice, by both, racing)."""

    def __init__(
        self,
        environment: launch_environments.LaunchEnvironment,
        woken: socket.socket,
        formed: socket.socket,
        started: float,
        timeout_s: float,
        output_dir: str,
    ):
        self.environment, self.woken, self.formed, self.output_dir = environment, woken, formed, output_dir
        self.started, self.timeout_s = started, timeout_s
        self.signals_lock = threading.Lock()  # held while one of the two acts on signals or hands them back
        self.watching = True

    @contextlib.contextmanager
    def acting_on_signals(self) -> Iterator[None]:
        """Inside, the stop signals and Ctrl-C reach the thread only; at the end, a signal it has not read yet is
        acted on here, then the handlers are the main thread's again. An ignored signal stays ignored."""
        previous = {}
        for signum in (*SIGNALS, signal.SIGINT):
            if signal.getsignal(signum) != signal.SIG_IGN:
                previous[signum] = signal.signal(signum, lambda received, frame: None)
        try:
            yield
        finally:
            with self.signals_lock:
                self._act_on_signals_received()
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
                self.watching = False

    def run(self) -> None:
        report_at = self.started + min(FIRST_REPORT_S, self.timeout_s / 2)
        bound = self.started + self.timeout_s + BOUND_GRACE_S
        while True:
            next_at = min(report_at, bound)
            ready, _, _ = select.select([self.woken, self.formed], [], [], max(0.0, next_at - time.monotonic()))
            if self.woken in ready:
                with self.signals_lock:  # once handed back, the main thread's handlers act: the bytes are read only
                    self._act_on_signals_received(act=self.watching)
            if self.formed in ready:
                return
            if self.woken in ready:
                continue
            if time.monotonic() >= bound:
                _never_formed(self.environment, self.timeout_s)
            line = self.environment.waiting_line(time.monotonic() - self.started, self.timeout_s)
            if line:
                print(f"waiting: {line}", file=sys.stderr, flush=True)
            report_at = time.monotonic() + REPORT_S

    def _act_on_signals_received(self, act: bool = True) -> None:
        try:
            received = self.woken.recv(64)
        except BlockingIOError:
            return
        for signum in received if act else b"":
            _stop(signum, self.output_dir)


def _never_formed(environment: launch_environments.LaunchEnvironment, timeout_s: float) -> None:
    """The bound passed with the main thread still in torch's rendezvous: its line, and the process ends."""
    end_forkserver()
    print(f"error: {environment.never_formed_line(timeout_s)}", file=sys.stderr, flush=True)
    os._exit(NEVER_FORMED_EXIT_CODE)


def _stop(signum: int, output_dir: str) -> None:
    """End the process for a stop signal that arrived while the group formed (other signals: nothing to do)."""
    if signum in SIGNALS:
        stop_before_training(signum, output_dir, "rendezvous")
    if signum == signal.SIGINT:
        end_forkserver()
        print("\ninterrupted (Ctrl-C) while the process group formed: nothing trained yet", file=sys.stderr, flush=True)
        os._exit(130)
