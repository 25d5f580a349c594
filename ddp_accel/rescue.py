"""A dead peer costs no training under DDP: the survivors save the step they reached before they exit.

Under DDP every rank holds a full replica of the model, the optimizer and the schedule, and ranks that agree at
every step (ddp_accel.agreement.StepAgreement) all stand at the same one when a collective fails because a peer is
gone. The restarted group needs one more thing of each rank: its random streams. The agreement compares a digest of
every rank's streams at each step (`StepAgreement(streams=True)`); where they were the same, the survivor's are
every rank's, and its checkpoint is the whole job's. So a survivor writes `step_N` of the step it reached, the files
every save writes (ddp_accel.checkpoint_format, for every rank: a `Replica`) and training_state.json, without a
collective: the group is broken. It writes into `.rescue_step_N`, which the first survivor creates (a directory
made atomically, also on a shared file system), and renames it into place once whole; a survivor killed meanwhile
(the launcher's grace ends, TORCH_ELASTIC_SHUTDOWN_TIMEOUT) leaves the last complete checkpoint as `latest`.

Under `ddp-accel launch --recover in-process` the survivors go on in their processes: each copies the step into
memory first (async_save.StagedWrites) and keeps it (checkpoint_format.hold), and the first writes its copy in a
thread of its own while the next group starts (checkpoint.wait_for_rescues: who needs the files waits for them).
At a hand-back (the launcher calls the replacements in) every process keeps its copy the same way, instead of a
stop's save (`keep_for_the_replacements`): the replacements are given one (ddp_accel.peer_copy).

Where no rank holds another's state, the restart goes on from the last checkpoint, said in one line: FSDP (each
rank holds its shard only), a component whose state is each rank's own (PowerSGD's error feedback), a failure
inside a gradient accumulation (a part of the step's gradients is each rank's), random streams that were not the
same on every rank, and a lost process 0 of a model with floating-point buffers other than norm layers' statistics
(a rank may update them with its batch; a checkpoint keeps process 0's). A norm layer's running statistics are each
rank's too, but process 0's travel in each step's agreement, so any survivor holds them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp_accel.agreement import StepAgreement, running_statistics
from ddp_accel.async_save import StagedWrites
from ddp_accel.checkpoint import RESCUE_WRITER, complete, step_folder, training_state_json
from ddp_accel.checkpoint_format import (
    TRAINING_STATE,
    Contents,
    HeldCheckpoint,
    Replica,
    WriteNow,
    hold,
    let_go_held,
    write_checkpoint,
)
from ddp_accel.random_streams import RandomStreams
from ddp_accel.recovery import under_in_process_recovery
from ddp_accel.state import RunIdentity, TrainState

REPLICATED = ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU")


def ranks_own_buffers(contents: Contents) -> bool:
    """Whether the models hold floating-point buffers a rank may update with its own batch that only process 0's
    are kept of (a checkpoint keeps process 0's; DDP broadcasts them at each forward). The norm layers' running
    statistics are not: process 0's travel in each step's agreement (`running_statistics`); SyncBatchNorm's are
    every rank's."""
    models = contents.objects.models
    shared = running_statistics(models)
    for index, model in enumerate(models):
        for prefix, module in model.named_modules():
            if isinstance(module, torch.nn.SyncBatchNorm):
                continue
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point() and (index, f"{prefix}.{name}" if prefix else name) not in shared:
                    return True
    return False


def why_not_rescued(accelerator: Any, contents: Contents) -> str | None:
    """Why a survivor of this run cannot save every rank's place (None: it can)."""
    kind = str(accelerator.distributed_type).split(".")[-1]
    if accelerator.num_processes < 2:
        return "one process"
    if kind not in REPLICATED:
        return f"{kind}: no rank holds another's shard"
    if contents.each_rank():
        return contents.each_rank()
    if accelerator.device.type != "cpu":  # (the agreement there is read a step late, its streams not compared yet)
        return "on a GPU the ranks' random streams are not compared per step"
    return None


def rescuable(accelerator: Any, contents: Contents) -> bool:
    """Whether a survivor of this run can save every rank's place (the agreement then compares the streams)."""
    return why_not_rescued(accelerator, contents) is None


def describe(accelerator: Any, contents: Contents) -> str | None:
    """The banner's line: what a lost peer costs this run."""
    reason = why_not_rescued(accelerator, contents)
    if reason == "one process":
        return None
    if reason is None and ranks_own_buffers(contents):
        return (
            "process 0 saves the step it reached when another process is lost (it holds the models' buffers); "
            "a lost process 0 costs the steps since the last checkpoint"
        )
    if reason is None:
        return "a survivor saves the step it reached (every rank holds the whole state)"
    return f"the restart resumes from the last checkpoint ({reason})"


def streams_of(state: TrainState, agreement: StepAgreement) -> RandomStreams | None:
    """Every rank's random streams after `state`'s step, where the ranks agreed they were the same: the agreed ones
    of that step, or (the agreement of this very step failed) this rank's, when they were the same a step before."""
    agreed, submitted = agreement.agreed_streams, agreement.submitted_streams
    if agreed is not None and agreed[0] == state.step:
        return agreed[1] if agreed[2] else None
    if submitted is not None and submitted[0] == state.step and agreed is not None and agreed[0] == state.step - 1:
        return submitted[1] if agreed[2] else None
    return None


def replica_of(accelerator: Any, state: TrainState, contents: Contents, agreement: StepAgreement) -> Replica | str:
    """What this process's copy of the step `state` reached gives every rank (a `Replica`), or why it cannot."""
    reason = why_not_rescued(accelerator, contents)
    streams = streams_of(state, agreement)
    if reason is None and state.step == 0:
        reason = "nothing was trained yet"
    if reason is None and streams is None:
        reason = f"the ranks' random streams at step {state.step} were not the same"
    buffers = buffers_of(state, agreement) if reason is None else None
    if reason is None and agreement.buffers and buffers is None:
        reason = f"the models' buffers at step {state.step} were not kept"
    if reason is not None:
        return reason
    assert streams is not None
    return Replica(streams, buffers or {}, accelerator.num_processes)


def save_what_survived(
    accelerator: Any,
    root: Path,
    state: TrainState,
    identity: RunIdentity,
    contents: Contents,
    agreement: StepAgreement,
    accumulation: int,
) -> str:
    """A survivor's checkpoint of the step it reached, when it can be every rank's; returns its line (also when
    the save itself fails: the lost peer's error is the run's). Under `--recover in-process` every survivor keeps
    a copy of the step for its next group (`hold`), and the first writes it in the background."""
    rank = accelerator.process_index
    replica = replica_of(accelerator, state, contents, agreement)
    if isinstance(replica, Replica) and state.batches_in_epoch % accumulation:
        replica = "the peer was lost inside a gradient accumulation"
    if isinstance(replica, Replica) and rank != 0 and ranks_own_buffers(contents):
        replica = "process 0 was lost, and the models' buffers a checkpoint keeps were its own"
    if isinstance(replica, str):
        return f"process {rank}: the restart resumes from the last checkpoint ({replica})"
    final, training_state = step_folder(root, state.step), json.dumps(training_state_json(state, identity), indent=2)
    rescue = root / f".rescue_step_{state.step}"  # (made by the first survivor, below)
    staged, held = None, None
    if under_in_process_recovery():  # the process goes on: it keeps its copy of the step
        try:
            staged, held = keep_a_copy(accelerator, rescue, final, contents, replica, training_state)
        except Exception as failed:
            return f"process {rank}: the step it reached was not saved ({failed})"
    if (final / TRAINING_STATE).is_file():
        return f"process {rank}: the step it reached ({state.step}) is saved already: {final}"
    try:
        claim(rescue)
    except FileExistsError:
        return f"process {rank}: another survivor saves step {state.step}"
    except OSError as failed:
        return f"process {rank}: the step it reached was not saved ({failed})"
    if staged is not None:
        write_in_background(staged.write_all, rescue, final, training_state, rank, held)
        return f"process {rank} writes the step it reached in the background (its group goes on from memory): {final}"
    try:
        write = functools.partial(write_checkpoint, accelerator, rescue, contents, WriteNow(), replica=replica)
        write_rescue(write, rescue, final, training_state)
    except Exception as failed:
        return f"process {rank}: the step it reached was not saved ({failed})"
    return f"process {rank} saved the step it reached for the restart: {final}"


def keep_a_copy(
    accelerator: Any, rescue: Path, final: Path, contents: Contents, replica: Replica, training_state: str
) -> tuple[StagedWrites, HeldCheckpoint | None]:
    """The step's files for every rank (`replica`) copied into memory, staged for `rescue`, and held for the next
    group (checkpoint_format.hold, unless its small files cannot be written: then the next group reads `final`)."""
    staged = StagedWrites()
    write_checkpoint(accelerator, rescue, contents, staged, replica=replica, create=False)
    try:
        return staged, hold(final, staged, rescue, contents.objects, training_state)
    except OSError:
        return staged, None


def claim(rescue: Path) -> None:
    """Make `rescue` (atomic: one writer) with the writer's pid in it (checkpoint.wait_for_rescues)."""
    rescue.mkdir(parents=True)
    (rescue / RESCUE_WRITER).write_text(str(os.getpid()))


def keep_for_the_replacements(
    accelerator: Any, root: Path, state: TrainState, identity: RunIdentity, contents: Contents, agreement: StepAgreement
) -> bool:
    """At a hand-back (`--recover in-process`: the survivors' group whole, at a step's end), instead of a stop's
    save: every process keeps a copy of the step for the next group, as a survivor of a loss does, and process 0
    writes it in the background; the replacements are given the copy by a peer. False on every process (they
    agree) where one could not (the models' buffers each rank's own among them): the step is then saved at once."""
    replica = replica_of(accelerator, state, contents, agreement)
    final, rescue = step_folder(root, state.step), root / f".rescue_step_{state.step}"
    training_state = json.dumps(training_state_json(state, identity), indent=2)
    staged, held = None, None
    if isinstance(replica, Replica) and not ranks_own_buffers(contents):
        with contextlib.suppress(Exception):  # (the step is then saved at once, which says a failure)
            staged, held = keep_a_copy(accelerator, rescue, final, contents, replica, training_state)
    kept = held is not None  # (its small files written too: a copy it can load)
    if accelerator.reduce(torch.tensor(float(not kept), device=accelerator.device), "sum").item():
        let_go_held()
        return False
    assert staged is not None
    if accelerator.is_main_process and not (final / TRAINING_STATE).is_file():
        with contextlib.suppress(OSError):  # (a rescue of this step in flight writes it)
            claim(rescue)
            write_in_background(staged.write_all, rescue, final, training_state, 0, held)
            say(f"process 0 writes step {state.step} in the background (its replacements are given it by a peer)")
    return True


def write_rescue(write: Callable[[], None], rescue: Path, final: Path, training_state: str) -> None:
    """The step's files into `rescue` (`write`), renamed to `final` once whole (removed on a failure)."""
    try:
        write()
        (rescue / RESCUE_WRITER).unlink()
        complete(rescue, final, training_state, None)
    except BaseException:
        shutil.rmtree(rescue, ignore_errors=True)
        raise


WRITES: list[threading.Thread] = []  # the rescues this process writes in the background


def write_in_background(
    write: Callable[[], None], rescue: Path, final: Path, training_state: str, rank: int, held: HeldCheckpoint | None
) -> None:
    """`write_rescue` in a thread of its own while the process goes on from its copy in memory (`held`: its next
    load copies what it would train on); whoever needs the files waits for them (checkpoint.wait_for_rescues)."""
    if held is not None:
        held.written_meanwhile = True

    def in_background() -> None:
        # the lowest priority: the training takes the cores first (Linux: a thread's own)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            write_rescue(write, rescue, final, training_state)
        except Exception as failed:
            say(f"process {rank}: the step it reached was not written ({failed}); its group went on from memory")

    WRITES.append(threading.Thread(target=in_background, name=f"ddp_accel rescue of {final.name}"))
    WRITES[-1].start()


def finish_writes() -> None:
    """Wait for the rescues written in the background (the process's end)."""
    while WRITES:
        WRITES.pop(0).join()


def buffers_of(state: TrainState, agreement: StepAgreement) -> dict[tuple[int, str], torch.Tensor] | None:
    """The models' buffers as `state`'s step left them (copied at its agreement), or None."""
    kept = agreement.submitted_buffers
    return kept[1] if kept is not None and kept[0] == state.step else None


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
