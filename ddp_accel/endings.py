"""How a script's process ends: `run_main` runs its main() and ends it one way for each outcome (a user error in one
line, exit 2; a preemption after its checkpoint, exit 0; a lost peer or running out of memory in one line; else the
traceback), records the outcome for a launcher that ran it in its own process, ends the DataLoader workers and their
helpers, and shuts the process group down once nothing of DDP's or gloo's is left (`shutdown`)."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from accelerate.utils.memory import should_reduce_batch_size

from ddp_accel import launch_environments, recovery
from ddp_accel.budget import note_command_start
from ddp_accel.elastic import end_with_the_launcher, process_rank, report_to_launcher, stop_restarts
from ddp_accel.errors import UserError
from ddp_accel.files import is_error
from ddp_accel.launch_environments import Outcome, record_outcome
from ddp_accel.loaders import end_worker_processes, kill_leftover_workers
from ddp_accel.startup import imports_done
from ddp_accel.stopping import (
    PEER_STOPPED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    EndedForAPeer,
    Phase,
    Preempted,
    StopSignals,
)


def shutdown(clean: bool) -> bool:
    """Tear down the process group after every DDP/gloo object is gone.

    The gloo teardown abort (`terminate called without an active exception`, ~1 run in 5) comes from
    DDP reducers and gloo work objects destroyed at interpreter exit, after their process group.
    `run_main` calls this once the script's main() has returned, so its locals (the prepared model,
    optimizer and loaders) are already released; garbage collection then destroys what reference
    cycles still hold before the group goes away. Without a group there is nothing to protect, and a full
    collection in a long-lived caller (a notebook, a test session) costs ~0.3 s a run.
    Returns False where a peer was lost at the end (its barrier failed: process 0 had written the outputs only if
    it is this process).
    """
    whole = True
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        if clean:
            try:
                dist.barrier()  # nobody destroys the group while a peer still uses it
            except Exception as error:
                if not lost_peers(error):
                    raise
                whole = False
        dist.destroy_process_group()
    return whole


def lost_peers(error: BaseException) -> bool:
    """A collective failed because another process is gone (it ended with its own error, or was killed)."""
    return isinstance(error, getattr(dist, "DistError", ())) or bool(
        re.search(
            r"Connection closed by peer|Connection reset by peer|Broken pipe|NCCL communicator was aborted"
            r"|Timed out waiting",
            str(error),
        )
    )


def a_loader_worker_lost(error: BaseException) -> bool:
    """A DataLoader worker of this process ended without an error of its own (killed: the OOM killer, a signal);
    torch's own words for it (a worker's own exception comes back as that exception)."""
    return isinstance(error, RuntimeError) and str(error).startswith("DataLoader worker (pid")


def _interrupted(signals: StopSignals) -> int:
    """Ctrl-C: one line (rank 0) with where to continue from; exit status 130."""
    signals.enter(Phase.DONE)
    if process_rank() == 0:
        print(f"\ninterrupted (Ctrl-C). {signals.resume_hint}", file=sys.stderr, flush=True)
    return 130


def _while_interrupted(error: BaseException) -> bool:
    """The error was raised while a KeyboardInterrupt was being handled (its context chain holds one)."""
    seen: set[int] = set()
    context: BaseException | None = error
    while context is not None and id(context) not in seen:
        if isinstance(context, KeyboardInterrupt):
            return True
        seen.add(id(context))
        context = context.__context__
    return False


def _one_line(error: UserError) -> str:
    """A UserError raised in a DataLoader worker reaches us wrapped in the worker's traceback: keep its message."""
    message = str(error)
    if "Original Traceback" in message:
        message = message.strip().splitlines()[-1].split("UserError: ", 1)[-1]
    return message


OUT_OF_MEMORY_ADVICE = (
    "the batch does not fit; --auto-batch-size finds the largest per-process batch that does and keeps the global "
    "batch by accumulating gradients (or lower --batch-size and raise --gradient-accumulation-steps; "
    "--mixed-precision bf16 halves the activations)"
)


def _first_sentence(error: BaseException) -> str:
    return str(error).strip().split(". ")[0].rstrip(".") or type(error).__name__


def run_main(main: Callable[..., Any]) -> None:
    """Run a script's main(): user errors as one line (exit 2), a preemption after its checkpoint (exit 0), a clean
    distributed shutdown (exit 0). The process's StopSignals watch SIGTERM/SIGUSR1/SIGHUP from here to the exit; a main
    that takes one argument receives them (to pass to fit). How it ended is recorded (launch_environments.last_outcome)
    for a launcher that ran the script in its own process."""
    imports_done()  # the collector paused for the imports runs again, what they made frozen
    signals = StopSignals()
    note_command_start(started_as_script=getattr(main, "__module__", None) == "__main__")  # --time-budget's clock
    launcher_watch = None
    try:
        signals.install()  # a signal that came during the imports is handled here: Preempted (nothing trained yet)
        launcher_watch = end_with_the_launcher()
        _main_through_regroups(main, signals)
        signals.enter(Phase.DONE)
        outcome = Outcome("completed", 0)
    except UserError as error:
        outcome = _user_error(error, signals)
    except Preempted as preempted:  # every rank saved its part of the checkpoint (or nothing was trained yet)
        signals.enter(Phase.DONE)
        if process_rank() == 0 or preempted.facts.before_training:  # any rank may be the one signalled
            print(preempted.message, file=sys.stderr, flush=True)
        code = PEER_STOPPED_EXIT_CODE if preempted.by_peer else PREEMPTED_EXIT_CODE
        outcome = Outcome("preempted", code, preempted.message, stop=dataclasses.asdict(preempted.facts))
        preempted.__traceback__ = None
    except EndedForAPeer as ended:  # the launcher ends the group: the failed process's line is the one to read
        signals.enter(Phase.DONE)
        outcome = Outcome("ended_for_a_peer", ended.code)
        ended.__traceback__ = None
    except KeyboardInterrupt:
        outcome = Outcome("interrupted", _interrupted(signals))
    except BaseException as error:
        if not is_error(error):  # SystemExit and the like: as they are
            raise
        signals.enter(Phase.DONE)
        outcome = _failed(error, signals)
    if launcher_watch is not None:
        launcher_watch.set()
    if recovery.under_in_process_recovery():  # a survivor's step, written in the background (ddp_accel.rescue)
        from ddp_accel.rescue import finish_writes

        finish_writes()
    record_outcome(outcome)
    if launch_environments.current().outlives_the_script:  # a Ray worker: its helpers serve the process, which goes on
        kill_leftover_workers()
    else:
        end_worker_processes()  # so that the command returns with nothing left in its process group
    rank = process_rank()
    if outcome.kind == "completed":
        recovery.say_completed()
    if not shutdown(clean=outcome.code in (0, PEER_STOPPED_EXIT_CODE)) and outcome.code == 0:
        outcome = _lost_at_the_end(rank, outcome)
    signals.uninstall()
    note_command_start(None)  # a later fit() in this process (a notebook) counts from its own start
    sys.exit(outcome.code)


def _lost_at_the_end(rank: int, outcome: Outcome) -> Outcome:
    """A peer lost after this process's run ended: process 0 reached the end's barrier with the outputs written
    (the run is whole); another process cannot know whether process 0 had, and ends as after a lost peer."""
    if rank == 0:
        print("process 0: a peer was lost after the run ended; its outputs are whole", file=sys.stderr, flush=True)
        return outcome
    message = (
        f"error: process {rank}: a peer was lost at the run's end, before every process was done (process 0 may not "
        "have written the outputs); the same command with --resume-from-checkpoint latest ends the run"
    )
    print(message, file=sys.stderr, flush=True)
    return Outcome("crashed", 1, message)


def _main_through_regroups(main: Callable[..., Any], signals: StopSignals) -> None:
    """main(), run again in this process after each lost peer under `ddp-accel launch --recover in-process`
    (ddp_accel.recovery): the survivor saved the step it reached, and resumes there in the launcher's next group;
    and after the copy or save of the step that the launcher asks for when a replacement joins."""
    while True:
        try:
            main(signals) if inspect.signature(main).parameters else main()
            return
        except recovery.Regroup as regroup:
            facts = regroup.facts
            _drop_frames(regroup)
        except Exception as error:  # a peer lost outside the loop (the group's start, its resume): its last save
            if not (recovery.under_in_process_recovery() and lost_peers(error)):
                raise
            print(
                f"process {process_rank()}: a peer was lost outside the training steps ({type(error).__name__}); "
                "the next group resumes from the last checkpoint",
                file=sys.stderr,
                flush=True,
            )
            facts = None
            _drop_frames(error)
        except Preempted as preempted:
            if not recovery.hand_back_asked():  # a stop: as it is
                raise
            facts = None  # every process saved the step reached: its replacement joins there
            _drop_frames(preempted)
        if recovery.hand_back_asked():  # (its signal called the replacements in: the next main trains on)
            signals.received, signals.phase = None, Phase.STARTUP
        # outside the handler, so that nothing holds the old group's model and loaders while the next one is built
        recovery.rejoin(facts)


def _drop_frames(error: BaseException) -> None:
    """The frames of `error` and of the errors it was raised during (the failed collective's): they hold the old
    group's model, loaders and process group."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop()
        if current is not None and id(current) not in seen:
            seen.add(id(current))
            current.__traceback__ = None
            stack += [current.__context__, current.__cause__]


# how long a process other than 0 that met a user error waits to be ended by its launcher (which ends the group
# once process 0, meeting the same error, exited with its line) before it says the error itself
PEER_REPORT_WAIT_S = 5.0


def _user_error(error: UserError, signals: StopSignals) -> Outcome:
    signals.enter(Phase.DONE)
    message = f"error: {_one_line(error)}"
    if process_rank() == 0 or error.every_process or not _ended_while_process_0_reports(signals):
        print(message, file=sys.stderr, flush=True)
    report_to_launcher(message)
    stop_restarts()  # a user error fails the same way at every restart of the launcher
    error.__traceback__ = None  # drop frames holding models before teardown
    return Outcome("user_error", 2, message)


def _ended_while_process_0_reports(signals: StopSignals) -> bool:
    """A process other than 0 with peers: whether its launcher ended it (a signal) within PEER_REPORT_WAIT_S. Exiting
    at once, it could have the launcher end process 0 before process 0 said the error: one line per run, never
    none. Not ended by then (process 0 met no such error), it says its own."""
    if launch_environments.current().world_size < 2:
        return False
    deadline = time.monotonic() + PEER_REPORT_WAIT_S
    while signals.received is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return signals.received is not None


def _failed(error: BaseException, signals: StopSignals) -> Outcome:
    """A crash: one line where the cause is known (a file, memory, a lost peer), else the traceback."""
    if _while_interrupted(error):  # a library's cleanup failed on the way out of a Ctrl-C (a worker pool's join)
        return Outcome("interrupted", _interrupted(signals))
    if isinstance(error, OSError) and error.filename is not None:  # read-only, full, a file for a folder...
        message = f"error: cannot write or read {error.filename}: {error.strerror}"
        if process_rank() == 0:
            print(message, file=sys.stderr, flush=True)
        report_to_launcher(message)
        stop_restarts()
        return Outcome("user_error", 2, message)
    if should_reduce_batch_size(error):  # a CUDA/cuDNN/CPU allocator's out of memory: what to change
        message = f"error: process {process_rank()} ran out of memory ({_first_sentence(error)}): "
        message += OUT_OF_MEMORY_ADVICE
        print(message, file=sys.stderr, flush=True)
    elif lost_peers(error):
        message = (
            f"error: process {process_rank()} lost contact with the others: another process ended (its own message "
            f"says why), or no answer came within the collective timeout (--timeout-s): a machine or the network "
            f"between them is gone ({type(error).__name__})"
        )
        print(message, file=sys.stderr, flush=True)
        return Outcome("crashed", 1, message)
    else:
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}"
    report_to_launcher(message)
    return Outcome("crashed", 1, message)
