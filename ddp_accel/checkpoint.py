"""Checkpoints, owned by one type (`Checkpoints`): when to save, crash-safe writing (the full `save_state` written
aside, then renamed into place), which are complete, which is latest, rotation, and loading under the run's
identity."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ddp_accel import launch_environments
from ddp_accel.async_save import CheckpointWriter, StagedWrites, leave_marker, write_then_mark
from ddp_accel.callback_state import POSITIONAL
from ddp_accel.checkpoint_format import (
    AcceleratorObjects,
    Contents,
    WriteNow,
    is_full_state_dict,
    unwrapped_optimizer,
    write_checkpoint,
)
from ddp_accel.config import CheckpointOptions
from ddp_accel.errors import UserError
from ddp_accel.files import finite_or_null, writing
from ddp_accel.identity import compare_identity
from ddp_accel.interval import AutoInterval, launch_started_at
from ddp_accel.sharding import before_save
from ddp_accel.state import Rebase, RunIdentity, TrainState

TRAINING_STATE = "training_state.json"  # TrainState.state_dict(), written last: a checkpoint without it is incomplete
FILE_LIST = "files.json"  # the name and size of every file of the checkpoint
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_folder(root: Path, step: int) -> Path:
    """The one place a checkpoint's name is made: `step_N` (N: the optimizer step, in the steps of the command that
    saved it)."""
    return root / f"step_{step}"


def every(step: int, period: int | str | None) -> bool:
    """Whether a periodic option (`--log-steps`, `--eval-steps`, `--checkpointing-steps`) is due at optimizer step
    `step`: every `period` steps; `period` None or 'epoch': never."""
    return isinstance(period, int) and step % period == 0


def model_fingerprint(model: torch.nn.Module) -> str:
    """Class name + hash of parameter names and shapes: tells a checkpoint of another model apart."""
    shapes = [(name, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    return f"{type(model).__name__}:{digest}"


# parameter-group options that decide what state the optimizer keeps (SGD's momentum buffers, Adam's max_exp_avg_sq,
# RMSprop's grad_avg): a checkpoint's state does not fit an optimizer without them. lr, betas, weight decay and the
# like only change the schedule and may change at a resume.
STATE_SHAPING_OPTIONS = ("momentum", "amsgrad", "centered")


def optimizer_fingerprint(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's type, its groups' sizes and the options that shape its state, e.g.
    `AdamW(4 params, amsgrad off)`; several (ddp_accel.Optimizers) joined with ' + '."""
    parts = []
    for inner in getattr(optimizer, "optimizers", None) or [optimizer]:
        groups = [
            ", ".join(
                [f"{len(group['params'])} params"]
                + [f"{key} {'on' if group[key] else 'off'}" for key in STATE_SHAPING_OPTIONS if key in group]
            )
            for group in inner.param_groups
        ]
        parts.append(f"{type(inner).__name__}({'; '.join(groups)})")
    return " + ".join(parts)


Reader = Callable[[Path], dict[str, Any]]  # a checkpoint's training_state.json


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


def read_training_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((path / TRAINING_STATE).read_text())
    return state


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


def checkpoint_problem(accelerator: Accelerator, path: Path, read: Reader | None = None) -> str | None:
    """Every rank checks the files of the checkpoint (names and sizes against the list saved with it, and that its
    own RNG state reads), then the ranks agree: returns what is wrong (as seen here, or on another rank) or None."""
    try:
        state = (read or read_training_state)(path)
        listed = json.loads((path / FILE_LIST).read_text()) if (path / FILE_LIST).is_file() else state.get("files", {})
        problem = None
        for name, size in listed.items():  # checkpoints of older versions list theirs in training_state.json
            if not (path / name).is_file():
                problem = f"{name} is missing"
            elif (path / name).stat().st_size != size:
                problem = f"{name} has {(path / name).stat().st_size} bytes, {size} when saved"
            if problem:
                break
        rng = path / f"random_states_{accelerator.process_index}.pkl"
        if problem is None and rng.is_file():
            torch.load(rng, weights_only=False)  # Accelerate would only log a failure here and go on with other RNG
    except Exception as error:  # unreadable JSON or pickle
        problem = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    damaged = accelerator.reduce(torch.tensor(float(problem is not None), device=accelerator.device), "sum")
    if damaged.item() and problem is None:
        problem = "damaged on another process"
    return problem


FSDP_MODEL_FOLDER = "pytorch_model_fsdp_0"  # what Accelerate's save_state writes under FSDP (a sharded state dict)


def check_strategy(accelerator: Accelerator, path: Path) -> None:
    """A checkpoint of FSDP shards loads only under FSDP (on any number of processes), and one of whole weights
    only without it: otherwise Accelerate fails deep inside on a file that is not there."""
    sharded = any(path.glob("pytorch_model_fsdp*"))  # the folder of a sharded state dict, or a full one's .bin
    if sharded == (accelerator.distributed_type == DistributedType.FSDP):
        return
    if sharded:
        raise UserError(
            f"checkpoint {path} holds an FSDP model ({FSDP_MODEL_FOLDER}/ or .bin), and this run does not shard "
            f"(distributed type {accelerator.distributed_type.value}): resume it under the FSDP config it was "
            "written with (e.g. accelerate_configs/fsdp.yaml, on any number of processes)"
        )
    raise UserError(
        f"checkpoint {path} holds whole weights (written without FSDP), and this run shards them with FSDP: "
        "resume it under the config it was written with (e.g. accelerate_configs/multi_gpu.yaml or cpu.yaml)"
    )


def load_checkpoint(
    accelerator: Accelerator,
    path: Path,
    identity: RunIdentity,
    state: TrainState | None = None,
    contents: Contents | None = None,
    read: Reader | None = None,
) -> list[str]:
    """Load the checkpoint at `path` into the prepared objects, `state` and the `contents`' callbacks and hooks, when
    the checkpoint is of this run's `identity` (a checkpoint of another model or run is refused). Without `contents`
    the callbacks' part is not read (an evaluation of the checkpoint's weights). Returns warnings to show."""
    saved, warning = check_checkpoint(accelerator, path, identity, read)
    try:
        load_accelerate_state(accelerator, path)
        if contents is not None and sharded_optimizer_left_unloaded(accelerator):
            load_sharded_optimizers(contents.objects, path)
    except (RuntimeError, FileNotFoundError, KeyError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load checkpoint {path}: {first_line}") from None
    notes = [warning] if warning else []
    for component in contents.components if contents is not None else []:
        notes += component.load(path, accelerator.process_index, accelerator.num_processes)
    if state is not None:
        state.load_state_dict(saved)
    return notes


def load_accelerate_state(accelerator: Accelerator, path: Path) -> None:
    """Accelerate's `load_state` of the checkpoint's Accelerate layout. It refuses files it has no registered object
    for: an earlier version's callback states (`custom_checkpoint_N.pkl`, read by their component) are left out of
    its sight (a folder of links to the others)."""
    if not any(POSITIONAL.match(entry.name) for entry in path.iterdir()):
        accelerator.load_state(str(path))
        return
    with tempfile.TemporaryDirectory(prefix=".ddp_accel_checkpoint_") as view:
        for entry in path.iterdir():
            if not POSITIONAL.match(entry.name):
                Path(view, entry.name).symlink_to(entry.resolve())
        accelerator.load_state(view)


# Accelerate before 1.13 loads an FSDP2 sharded optimizer state into the template `optimizer.state_dict()`, empty
# until the first step: nothing is loaded, silently (the optimizer restarts at every resume); 1.13 asks torch's
# get_optimizer_state_dict for the template, as load_sharded_optimizers does
SHARDED_OPTIMIZER_LOADED_FROM = (1, 13)


def sharded_optimizer_left_unloaded(accelerator: Accelerator) -> bool:
    """Whether this Accelerate's load_state left an FSDP2 run's sharded optimizer state unloaded."""
    import accelerate

    if accelerator.distributed_type != DistributedType.FSDP or is_full_state_dict(accelerator.state.fsdp_plugin):
        return False
    version = tuple(int(part) for part in accelerate.__version__.split(".")[:2] if part.isdigit())
    return accelerator.state.fsdp_plugin.fsdp_version == 2 and version < SHARDED_OPTIMIZER_LOADED_FROM


def load_sharded_optimizers(objects: AcceleratorObjects, path: Path) -> None:
    """Each optimizer's shards of `path` (`optimizer_N/`, Accelerate's layout), by torch's public state-dict API:
    the template from get_optimizer_state_dict, then torch.distributed.checkpoint's load. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    for index, optimizer in enumerate(objects.optimizers):
        model, optimizer = objects.models[index], unwrapped_optimizer(optimizer)
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path / f"optimizer_{index}"))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def check_checkpoint(
    accelerator: Accelerator, path: Path, identity: RunIdentity, read: Reader | None = None
) -> tuple[dict[str, Any], str | None]:
    """Every check before a load (complete on every rank, the model, the optimizer, sharded or not, the options of
    the identity): its training state and a warning to show, or a UserError."""
    problem = checkpoint_problem(accelerator, path, read)
    if problem:
        raise UserError(f"checkpoint {path} is damaged ({problem}); resume another step_N folder or 'latest'")
    saved = (read or read_training_state)(path)
    if saved.get("model_fingerprint") != identity.model_fingerprint:
        raise UserError(
            f"checkpoint {path} was written by another model ({saved.get('model_fingerprint')}, "
            f"this run builds {identity.model_fingerprint}); resume with the same model options or use a new "
            "--output-dir."
        )
    saved_optimizer = saved.get("optimizer_fingerprint")  # not in checkpoints of earlier versions
    if saved_optimizer and identity.optimizer_fingerprint and saved_optimizer != identity.optimizer_fingerprint:
        raise UserError(
            f"checkpoint {path} was written with another optimizer ({saved_optimizer}; this run makes "
            f"{identity.optimizer_fingerprint}): its state cannot continue here. Resume with the same optimizer "
            "options, or start a new run (another --output-dir) from the checkpoint's model.safetensors."
        )
    check_strategy(accelerator, path)
    check_random_states(accelerator, path)
    if saved.get("checkpoint_format", 1) < 2:
        misplaced = misplaced_optimizer_state(path)
        if misplaced:
            raise UserError(
                f"checkpoint {path} was written by an earlier ddp-accel with --async-checkpoint under "
                f"fsdp_state_dict_type FULL_STATE_DICT, and its optimizer state is not its step's ({misplaced}): a "
                "resume from it would not continue the run. Resume from a checkpoint saved without "
                "--async-checkpoint, or start again (another --output-dir)."
            )
    warning = (
        compare_identity(saved.get("identity"), identity.identity, f"checkpoint {path}") if identity.identity else None
    )
    return saved, warning


def check_random_states(accelerator: Accelerator, path: Path) -> None:
    """Every rank's RNG states load as Accelerate's load_state will load them (`accelerate.utils.load`, which only
    logs a failure and goes on with other random streams: a resume that is not exact, silently); the ranks agree.
    numpy 1's unpickler cannot read numpy 2's arrays, for one."""
    from accelerate.utils import load

    rng = path / f"random_states_{accelerator.process_index}.pkl"
    problem = None
    if rng.is_file():
        try:
            load(rng)
        except Exception as error:
            problem = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    failed = accelerator.reduce(torch.tensor(float(problem is not None), device=accelerator.device), "sum")
    if failed.item():
        raise UserError(
            f"checkpoint {path}: this Accelerate cannot read its random states ({problem or 'on another process'}), "
            "so a resume would not continue it exactly; resume it under the libraries it was written with (numpy's "
            "major version among them), or start a new run from its model"
        )


def misplaced_optimizer_state(path: Path) -> str | None:
    """An FSDP FULL_STATE_DICT checkpoint (pytorch_model_fsdp.bin and optimizer.bin) whose optimizer state holds a
    tensor with exactly the bytes of one of the model's: what the asynchronous staging of earlier versions wrote
    when a gathered optimizer tensor reused the memory of a model tensor staged and freed before it. None when
    there is none (tensors of zeros and single values left out: they can be equal by chance)."""
    model_file, optimizer_file = path / (FSDP_MODEL_FOLDER.removesuffix("_0") + ".bin"), path / "optimizer.bin"
    if not (model_file.is_file() and optimizer_file.is_file()):
        return None

    def contents(tensor: torch.Tensor) -> bytes | None:
        if tensor.numel() < 2 or not tensor.any():
            return None
        return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    model = torch.load(model_file, map_location="cpu", weights_only=True)
    weights = {contents(tensor): name for name, tensor in model.items() if isinstance(tensor, torch.Tensor)}
    weights.pop(None, None)
    optimizer = torch.load(optimizer_file, map_location="cpu", weights_only=True)
    for parameter, values in optimizer.get("state", {}).items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and contents(value) in weights:
                return f"{key} of {parameter} holds the weights of {weights[contents(value)]}"
    return None


def load_sharded_model(model: torch.nn.Module, path: Path) -> None:
    """The model of an FSDP checkpoint (its shards in `pytorch_model_fsdp_0/`, torch.distributed.checkpoint) into
    the bare `model` on every rank, whole: what an evaluation needs, where no optimizer state is wanted. Every rank
    calls it."""
    import torch.distributed.checkpoint as dcp

    full = path / (FSDP_MODEL_FOLDER.removesuffix("_0") + ".bin")  # fsdp_state_dict_type FULL_STATE_DICT's file
    state = {"model": model.state_dict()}
    try:
        if full.is_file():
            state["model"] = torch.load(full, map_location="cpu", weights_only=True)
        else:
            dcp.load(state, checkpoint_id=str(path / FSDP_MODEL_FOLDER))
    except Exception as error:  # torch's CheckpointException lists each rank's failure
        raise UserError(f"cannot load checkpoint {path}: {str(error).strip().splitlines()[0]}") from None
    model.load_state_dict(state["model"])


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
        return resolve_resume(value, self.root, self.accelerator, self.listing)

    def load(self, path: Path, state: TrainState, identity: RunIdentity) -> list[str]:
        return load_checkpoint(self.accelerator, path, identity, state, self.contents, self.listing.state)

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
        return path


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str, target: str) -> None:
    """`weights` into `model`; weights of another model are one line: `{source} holds weights of another model
    than {target} (the first mismatch)`."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        lines = str(error).splitlines()
        first = lines[1].strip() if len(lines) > 1 else lines[0]
        raise UserError(f"{source} holds weights of another model than {target} ({first})") from None


def strip_module_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DDP saves `module.layer.weight`; the bare model wants `layer.weight`."""
    prefix = "module."
    if state_dict and all(key.startswith(prefix) for key in state_dict):
        return {key[len(prefix) :]: value for key, value in state_dict.items()}
    return state_dict


def load_plain_ddp_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint written by a classic DDP script into an unwrapped model.

    Accepts `{'epoch', 'step', 'model_state_dict', 'optimizer_state_dict', ...}` or a bare state dict,
    with or without the `module.` prefix. Returns the remaining entries (epoch, step, loss...).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickles with arbitrary objects are refused by weights_only
        raise UserError(f"{path}: cannot be loaded safely with weights_only=True ({type(error).__name__})") from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"{path}: expected a dict checkpoint, found {type(checkpoint).__name__}")
    model_state = checkpoint.get("model_state_dict", checkpoint)
    try:
        model.load_state_dict(strip_module_prefix(model_state))
    except RuntimeError as error:
        raise UserError(
            f"{path} does not fit this model: {str(error).splitlines()[0]} "
            f"{str(error).splitlines()[1].strip() if len(str(error).splitlines()) > 1 else ''}"
        ) from None
    if optimizer is not None and "optimizer_state_dict" in checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    return {key: value for key, value in checkpoint.items() if key not in ("model_state_dict", "optimizer_state_dict")}
