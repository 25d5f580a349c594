"""The checkpoints' policy, owned by one type (`Checkpoints`): when to save, where, crash-safe completion (written
aside, then renamed into place), which are complete, which is latest, rotation, and the resume under the run's
identity. What a checkpoint holds, and how it is written and read: ddp_accel.checkpoint_format."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ddp_accel import launch_environments, recovery
from ddp_accel.async_save import CheckpointWriter, StagedWrites, leave_marker, write_then_mark
from ddp_accel.checkpoint_format import (
    FILE_LIST,
    TRAINING_STATE,
    Contents,
    Reader,
    WriteNow,
    checkpoint_problem,
    held_step,
    load_checkpoint,
    read_training_state,
    share_held,
    take_held,
    write_checkpoint,
)
from ddp_accel.config import CheckpointOptions
from ddp_accel.errors import UserError
from ddp_accel.files import finite_or_null, writing
from ddp_accel.interval import AutoInterval, launch_started_at
from ddp_accel.plain_ddp import load_plain_ddp_checkpoint  # noqa: F401 (a public name here too)
from ddp_accel.sharding import before_save
from ddp_accel.state import Rebase, RunIdentity, TrainState

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_folder(root: Path, step: int) -> Path:
    """The one place a checkpoint's name is made: `step_N` (N: the optimizer step, in the steps of the command that
    saved it)."""
    return root / f"step_{step}"


def every(step: int, period: int | str | None) -> bool:
    """Whether a periodic option (`--log-steps`, `--eval-steps`, `--checkpointing-steps`) is due at optimizer step
    `step`: every `period` steps; `period` None or 'epoch': never."""
    return isinstance(period, int) and step % period == 0


def complete_checkpoints(root: Path, read: Reader | None = None) -> list[Path]:
    """`step_N` folders that finished writing, oldest first: by how far training had got (epoch, samples into it),
    not by N alone. A resume with another global batch (another world size, an elastic join or leave) counts
    steps of the new size from a lower N, next to the higher N of earlier, older checkpoints."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / TRAINING_STATE).is_file():
            found.append((training_progress(path, read), int(match.group(1)), path.name, path))
    return [path for *_, path in sorted(found)]


class Listing:
    """A run's checkpoint folder as read: its complete checkpoints, oldest first, and each one's
    training_state.json, each read once until `refresh` (a save changes the folder). The output folder holds one
    (`RunFolder.listing`), which its checks and the run's Checkpoints share."""

    def __init__(self, root: Path):
        self.root = root
        self._complete: list[Path] | None = None
        self._states: dict[Path, dict[str, Any] | Exception] = {}

    def refresh(self) -> None:
        self._complete, self._states = None, {}

    def state(self, path: Path) -> dict[str, Any]:
        if path not in self._states:
            try:
                self._states[path] = read_training_state(path)
            except (OSError, ValueError) as error:  # (read again, it would fail again)
                self._states[path] = error
        value = self._states[path]
        if isinstance(value, Exception):
            raise value
        return value

    def complete(self) -> list[Path]:
        if self._complete is None:
            self._complete = complete_checkpoints(self.root, self.state)
        return list(self._complete)

    def saved_plan(self, value: str | None) -> tuple[dict[str, Any] | None, Path | None]:
        """The --time-budget plan recorded by the checkpoint `value` names (None when it has none), and that
        checkpoint when it was trained without a plan. (None, None) when there is no checkpoint or it cannot be
        read (the resume says why)."""
        path = resolve_resume(value, self.root, listing=self)  # (its integrity is checked at the resume)
        if path is None:
            return None, None
        try:
            plan = self.state(path).get("time_budget")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None, None
        return (plan, None) if plan else (None, path)


def training_progress(path: Path, read: Reader | None = None) -> tuple[float, float]:
    """(epoch, samples seen in it) of a checkpoint; one whose training_state.json cannot be read sorts as the
    newest, so that `latest` reports it as damaged rather than passing over it."""
    try:
        progress = TrainState()
        progress.load_state_dict((read or read_training_state)(path))
        return float(progress.epoch), float(progress.samples_in_epoch)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return math.inf, math.inf


def resolve_resume(
    value: str | None, root: Path, accelerator: Accelerator | None = None, listing: Listing | None = None
) -> Path | None:
    """`latest` -> the newest complete and intact checkpoint (a damaged one is skipped, saying so), or None (a
    first start); a path must be a complete checkpoint (whether it is intact, load_checkpoint checks). `listing`:
    the folder as the run read it."""
    if value is None:
        return None
    listing = listing or Listing(root)
    if value == "latest":
        for path in reversed(listing.complete()):
            problem = checkpoint_problem(accelerator, path, listing.state) if accelerator is not None else None
            if problem is None:
                return path
            if accelerator is not None and accelerator.is_main_process:
                print(
                    f"warning: checkpoint {path} is damaged ({problem}); trying the one before it",
                    file=sys.stderr,
                    flush=True,
                )
        return None
    path = Path(value)
    if not path.exists():
        raise UserError(
            f"--resume-from-checkpoint {value}: no such checkpoint. Use a folder like "
            f"{root}/step_N, or 'latest' to resume the newest one (or start fresh if none)."
        )
    if not (path / TRAINING_STATE).is_file():
        raise UserError(
            f"--resume-from-checkpoint {value}: not a complete ddp_accel checkpoint "
            f"(no {TRAINING_STATE}); pick another step_N folder."
        )
    return path


# 2: written by a version whose asynchronous saves stage each object apart (format 1, before it: an FSDP
# FULL_STATE_DICT checkpoint saved with --async-checkpoint on several processes may hold misplaced optimizer state)
CHECKPOINT_FORMAT = 2


def training_state_json(progress: TrainState, identity: RunIdentity) -> dict[str, Any]:
    """What training_state.json holds: where training is, who the run is, and the format of the checkpoint."""
    return finite_or_null({**progress.state_dict(), **identity.state_dict(), "checkpoint_format": CHECKPOINT_FORMAT})


def save_checkpoint(
    accelerator: Accelerator,
    root: Path,
    state: TrainState,
    identity: RunIdentity,
    limit: int | None = None,
    contents: Contents | None = None,
    writer: CheckpointWriter | None = None,
) -> Path:
    """Every process calls this (save_state is collective). Returns the final folder.

    The state goes to `.tmp_step_N` first; the main process writes the callbacks' states, the list of its files
    and then training_state.json, and renames it to `step_N` only after every rank wrote its part, so a crash
    mid-save leaves no folder that `latest` would pick up. With a `writer` (--async-checkpoint) the `contents`
    are staged in memory and written by the writer's thread, which completes the checkpoint the same way
    (async_save.py).
    """
    final = step_folder(root, state.step)
    partial = final.with_name(".tmp_" + final.name)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    training_state = json.dumps(training_state_json(state, identity), indent=2)  # as it is now
    main, rank, ranks = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    contents = contents or Contents()
    with writing(partial, cleanup=partial):
        before_save(accelerator, contents.objects.models)  # under FSDP: the buffers every rank will load
        assert writer is None or not writer.busy, "staged over a write in flight"  # (Checkpoints waits first)
        staged = StagedWrites(writer.buffers) if writer is not None else None
        write_checkpoint(accelerator, partial, contents, staged or WriteNow(), writer.groups if writer else None)
    if writer is None or staged is None:  # written at once (both: for the type checker)
        accelerator.wait_for_everyone()
        if main:
            with writing(partial, cleanup=partial):
                complete(partial, final, training_state, limit)
        accelerator.wait_for_everyone()
        return final

    def write_and_complete() -> None:
        try:  # only the main process's writer removes the shared folder of a failed write
            with writing(partial, cleanup=partial if main else None):
                finish = functools.partial(complete, partial, final, training_state, limit) if main else None
                write_then_mark(staged, partial, rank, ranks, finish)
        except BaseException:
            if not main:
                with contextlib.suppress(OSError):
                    leave_marker(partial, rank, failed=True)
            raise

    writer.start(write_and_complete)
    return final


RESCUE_WRITER = "writer.pid"  # in a survivor's `.rescue_step_N` while it writes it (ddp_accel.rescue)


def wait_for_rescues(root: Path, timeout_s: float = 300.0) -> None:
    """Until the rescues of `root` in flight (`.rescue_step_N`, written by a survivor in the background under
    in-process recovery) are renamed into place or given up: by a failure, or by their writer's death (a process
    of this machine: its pid)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(writing_alive(rescue) for rescue in root.glob(".rescue_step_*")):
        time.sleep(0.02)


def writing_alive(rescue: Path) -> bool:
    """Whether `rescue` is being written: its writer alive (the process of its pid, started before it named
    itself), or its writer not named yet (its folder just made)."""
    import psutil

    writer = rescue / RESCUE_WRITER
    try:
        pid, named_at = int(writer.read_text() or 0), writer.stat().st_mtime
    except (OSError, ValueError):  # made and its writer not named yet, or being completed; else long given up
        with contextlib.suppress(OSError):
            return time.time() - rescue.stat().st_mtime < 10
        return False
    try:
        return psutil.Process(pid).create_time() <= named_at + 1
    except psutil.Error:  # (no such process: the writer died)
        return False


def complete(partial: Path, final: Path, training_state: str, limit: int | None) -> None:
    """The main process, once every rank's files are in `partial`: the list of its files (checked on load: names and
    sizes, cheap inside a preemption's grace period), training_state.json, the rename, the rotation."""
    files = {str(f.relative_to(partial)): f.stat().st_size for f in sorted(partial.rglob("*")) if f.is_file()}
    (partial / FILE_LIST).write_text(json.dumps(files, indent=1))
    (partial / TRAINING_STATE).write_text(training_state)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    if limit:
        for old in complete_checkpoints(final.parent)[:-limit]:
            shutil.rmtree(old, ignore_errors=True)


# the watchdog's bound for a save: (what, kind); a kind's bound is learned from its own durations, None: generous
SaveActivity = Callable[[str, "str | None"], "contextlib.AbstractContextManager[Any]"]


class Checkpoints:
    """The checkpoints of one run, in OUTPUT_DIR/checkpoints: when to save (`maybe_save`: every N optimizer steps
    or at each epoch's end), where (`step_folder`) and what (the full `save_state`, the callbacks' states by key,
    training_state.json), which are complete, which is latest, rotation (keep the newest `limit`), and loading
    under the run's identity. Every rank holds one and calls its collective methods (save, resolve, load) together.
    `folder`: the checkpoints folder, or its Listing (the folder as read, shared with the run's folder checks).
    `activity`: what a save runs under (the run's watchdog); `on_saved`: told (path, seconds) after every save.
    `of_run` builds a run's from its options."""

    def __init__(
        self,
        accelerator: Accelerator,
        folder: Path | Listing,
        every: int | str | None = None,
        limit: int | None = None,
        contents: Contents | None = None,
        activity: SaveActivity | None = None,
        on_saved: Callable[[Path, float], None] | None = None,
    ):
        self.listing = folder if isinstance(folder, Listing) else Listing(folder)  # refreshed by each save
        self.accelerator, self.root, self.every, self.limit = accelerator, self.listing.root, every, limit
        self.contents = contents or Contents()
        self.leftover = 0  # samples of the epoch the resume sees again (its skip rounded down to this global batch)
        self.rebase: Rebase | None = None  # the resume's, once resumed
        self.activity: SaveActivity = activity or (lambda what, kind: contextlib.nullcontext())
        self.on_saved: list[Callable[[Path, float], None]] = [on_saved] if on_saved else []
        self.writer: CheckpointWriter | None = None  # --async-checkpoint: saves written in the background
        self.in_flight: tuple[Path, float] | None = None  # the background save: its folder and the step's stall
        self.auto: AutoInterval | None = None  # --checkpointing-steps auto
        self.bulk_from: str | None = None  # where the last load took the bulk of its states from, if not files

    @classmethod
    def of_run(
        cls,
        accelerator: Accelerator,
        options: CheckpointOptions,
        listing: Listing,
        contents: Contents,
        covered: bool,
        activity: SaveActivity,
        on_saved: Callable[[Path, float], None],
    ) -> Checkpoints:
        """A run's, in `listing`'s folder, saving `contents`: --checkpointing-steps (`auto`: at the interval
        AutoInterval chooses; `covered`: a survivor's save covers the failure of some ranks), --checkpoint-limit,
        --async-checkpoint (a writer of its own)."""
        every, limit = options.checkpointing_steps, options.checkpoint_limit
        checkpoints = cls(accelerator, listing, every, limit, contents, activity, on_saved)
        if options.async_checkpoint:
            checkpoints.writer = CheckpointWriter(sharded=accelerator.distributed_type == DistributedType.FSDP)
        if every == "auto":
            restarts = launch_environments.current().restarts
            checkpoints.auto = AutoInterval(options.mtbf, covered, restarts, launch_started_at(), accelerator.device)
        return checkpoints

    def due_at_step(self, step: int) -> bool:
        return self.auto.due(step) if self.auto is not None else every(step, self.every)

    def due_at_epoch_end(self) -> bool:
        return self.every == "epoch"

    def complete(self) -> list[Path]:
        return self.listing.complete()

    def holds(self, state: TrainState, identity: RunIdentity) -> bool:
        """Whether step_N of this state was saved with exactly this state (a stop right after a save)."""
        path = step_folder(self.root, state.step) / TRAINING_STATE
        try:
            return json.loads(path.read_text()) == json.loads(json.dumps(training_state_json(state, identity)))
        except (OSError, ValueError):
            return False

    def save(self, state: TrainState, identity: RunIdentity, in_background: bool = False) -> Path:
        writer = self.writer if in_background else None
        self.listing.refresh()
        try:
            return save_checkpoint(self.accelerator, self.root, state, identity, self.limit, self.contents, writer)
        finally:
            self.listing.refresh()

    def maybe_save(self, state: TrainState, identity: RunIdentity, epoch_end: bool = False) -> Path | None:
        """The policy: the checkpoint of this step when one is due (`epoch_end`: an epoch just ended)."""
        due = self.due_at_epoch_end() if epoch_end else self.due_at_step(state.step)
        return self.save_now(state, identity) if due else None

    def save_now(self, state: TrainState, identity: RunIdentity, in_background: bool = True) -> Path:
        """This step's checkpoint; with --async-checkpoint (unless not `in_background`) staged, written by the
        writer: its listeners hear of it once it is complete (`finish_writes`)."""
        self.finish_writes()  # one write at a time
        background = in_background and self.writer is not None
        # a kind of its own for each way of saving: the watchdog bounds each by its own longest duration (a staging
        # copy takes a tenth of a whole write: a stop's save at once must not be held to the staging's pace)
        kind = "checkpoint" if background or self.writer is None else "checkpoint written at once"
        started = time.perf_counter()
        with self.activity(f"the checkpoint of step {state.step}", kind):
            path = self.save(state, identity, background)
        stall = time.perf_counter() - started
        if background:
            self.in_flight = (path, stall)
        else:
            self._saved(path, stall)
        if self.auto is not None:
            self.auto.saved(state.step, stall)
        return path

    def finish_writes(self) -> None:
        """Every rank, at the same point (a save, a stop, the end): the background write in flight waited for, then
        the ranks agree whether every write succeeded (an error is raised on every rank), and its listeners are
        told the save's whole cost (staging and write: what a stop's save at once would take)."""
        if self.writer is None or self.in_flight is None:
            return
        path, stall = self.in_flight
        self.in_flight = None
        error: BaseException | None = None
        with self.activity(f"the write of {path.name}", None):  # its pace is the disk's: the generous bound
            try:
                self.writer.wait()
            except Exception as failure:  # the ranks agree first: a rank that raised alone would leave the
                error = failure  # others waiting in the next collective
        failed = self.accelerator.reduce(torch.tensor(float(error is not None), device=self.accelerator.device))
        if error is not None:
            raise error
        if failed.item():
            raise UserError(f"the checkpoint {path.name} was not written: another process failed (its own message)")
        self._saved(path, stall + self.writer.last_write_s)

    def abandon_writes(self, timeout_s: float = 30.0) -> None:
        """A run that ends without finish_writes (it failed): its write in flight gets `timeout_s` to end."""
        if self.writer is not None:
            self.writer.abandon(timeout_s)

    def _saved(self, path: Path, seconds: float) -> None:
        self.listing.refresh()  # (an asynchronous save completes its folder in the writer thread)
        for listener in self.on_saved:
            listener(path, seconds)

    def save_reached(self, state: TrainState, identity: RunIdentity) -> Path:
        """A stop's checkpoint of the step reached (after the write in flight, written at once), unless this very
        state was just saved."""
        self.finish_writes()
        if self.holds(state, identity):
            return step_folder(self.root, state.step)
        return self.save_now(state, identity, in_background=False)

    def resolve(self, value: str | None) -> Path | None:
        """`resolve_resume`; under in-process recovery, the step the group's survivors hold in memory (its files
        may still be being written; a replacement is given their copy), or else once the rescues in flight are
        written."""
        if value == "latest" and recovery.under_in_process_recovery():
            survivors_hold = recovery.step_the_survivors_hold()
            if survivors_hold is not None:
                path = step_folder(self.root, survivors_hold)
                share_held(path, survivors_hold)  # (a replacement is given a survivor's copy)
                if held_step() != survivors_hold:  # (the launcher's plan says every survivor reported it)
                    raise RuntimeError(f"step {survivors_hold} is not held by this process")
                return path
            wait_for_rescues(self.root)
            self.listing.refresh()
        return resolve_resume(value, self.root, self.accelerator, self.listing)

    def load(self, path: Path, state: TrainState, identity: RunIdentity) -> list[str]:
        held = take_held(path)  # (a survivor's own copy of the step under in-process recovery, or one given it)
        given = held is not None and held.given_by is not None
        self.bulk_from = None if held is None else f"process {held.given_by} (given)" if given else "its memory"
        return load_checkpoint(self.accelerator, path, identity, state, self.contents, self.listing.state, held)

    def resume(
        self,
        value: str | None,
        state: TrainState,
        identity: RunIdentity,
        batches_per_epoch: int,
        accumulation: int,
        total_steps: int,
    ) -> Path | None:
        """`--resume-from-checkpoint` into the prepared objects and `state`, continued at this command's global
        batch and accumulation (TrainState.rebase); a checkpoint past the steps this command asks for is refused.
        Returns the checkpoint loaded, or None (a first start)."""
        accelerator = self.accelerator
        path = self.resolve(value)
        if path is None:
            return None
        global_batch, world_size = state.global_batch, state.world_size
        for warning in self.load(path, state, identity):
            accelerator.print(f"warning: {warning}")
        rebase = self.rebase = state.rebase(global_batch, world_size, batches_per_epoch, accumulation)
        self.leftover = rebase.leftover
        changed = rebase.warning(state, total_steps)
        if changed and accelerator.is_main_process:
            print(f"warning: {changed}", file=sys.stderr, flush=True)
        if state.step > total_steps:
            raise UserError(
                f"checkpoint {path} is at step {state.step}, past the {total_steps} steps this command asks for; "
                "raise --epochs or --max-steps, or give an earlier step_N folder to --resume-from-checkpoint"
            )
        scale = f", fp16 loss scale {accelerator.scaler.get_scale():g}" if accelerator.scaler is not None else ""
        accelerator.print(
            f"resumed from {path}: step {state.step}, epoch {state.epoch}, skipping {rebase.skip} batches of the "
            f"epoch{scale}"
        )
        if self.bulk_from:  # (each process's own line: which of them read the bulk back)
            line = f"process {accelerator.process_index}: the models' and optimizers' states from {self.bulk_from}"
            print(line, file=sys.stderr, flush=True)
        return path
