"""The output folder of one run and its lifecycle: the check before anything is written, the lock, the deletions of
`--overwrite-output-dir`, the final artifacts staged in `checkpoints/.final/` and committed together, and whether a
run is already complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save, save_file

from ddp_accel import bad_samples
from ddp_accel.checkpoint import Listing
from ddp_accel.errors import UserError
from ddp_accel.files import write_json, writing
from ddp_accel.identity import compare_identity
from ddp_accel.locking import lock_output_dir
from ddp_accel.stopping import PREEMPTED_MARKER
from ddp_accel.tracking import TRACKER_RUNS

FINAL_STAGING = ".final"  # under checkpoints/: the final model and the best model, until the commit moves them
COMMITTED = "metrics.json"  # written last by a commit: a run is complete once it exists for its steps


def check_weights_writable(model: torch.nn.Module) -> None:
    """Checkpoints and model.safetensors are safetensors files: a dtype of `model`'s that the installed safetensors
    cannot write is refused in one line before training, not after it (complex64 needs safetensors >= 0.7)."""
    names_by_dtype: dict[torch.dtype, str] = {}
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            names_by_dtype.setdefault(tensor.dtype, name)
    for dtype, name in names_by_dtype.items():
        try:
            save({"weights": torch.zeros(1, dtype=dtype)})
        except Exception:  # safetensors says KeyError or TypeError, by version
            raise UserError(
                f"the model's {name} is {str(dtype).removeprefix('torch.')}, which safetensors "
                f"{version('safetensors')} cannot write (checkpoints and model.safetensors are safetensors files): "
                "pip install -U safetensors, or keep the weights in a dtype it writes"
            ) from None


def ended_by_early_stopping(metrics: dict[str, Any]) -> bool:
    """Whether committed metrics say early stopping ended the run (metrics.json's `end_reason`)."""
    return str(metrics.get("end_reason", "")).startswith("early stopping")


def ended_by_the_time_budget(metrics: dict[str, Any]) -> bool:
    """Whether committed metrics say --time-budget ended the run before its plan (a slower machine)."""
    return str(metrics.get("end_reason", "")).startswith("time budget")


class RunFolder:
    """OUTPUT_DIR: `checkpoints/` (the Checkpoints' root), `checkpoints/.final/` (what the commit will move into
    place), and the committed artifacts. Only the main process writes here, except the collective model save."""

    def __init__(self, path: str | Path):
        self.given = str(path)  # Path("") is "."
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.staging = self.checkpoints / FINAL_STAGING
        self.listing = Listing(self.checkpoints)  # the checkpoints as read: this folder's checks and its run's
        self._lock: int | None = None
        self.checked = False  # decided by the early check (all but `latest`, which needs fit's checkpoints)

    # --- before anything is written ---
    def check(self, resume_from_checkpoint: str | None, overwrite: bool, has_checkpoints: bool | None = None) -> None:
        """The Hugging Face convention: a new run does not silently replace a trained model or the checkpoints of
        an unfinished run. A run that resumes from a checkpoint is not affected; `latest` without a checkpoint is a
        new run. `has_checkpoints` None: the early check, before fit can tell a complete run from one to refuse
        (`latest` passes then). Nothing is deleted here: see `clear_previous_run`."""
        if self.given.strip() == "":
            raise UserError("--output-dir is empty; name a folder (it is created if missing)")
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"--output-dir {self.path} is a file; pass a folder (it is created if missing)")
        if has_checkpoints is None:
            if resume_from_checkpoint == "latest":
                return
            has_checkpoints = bool(self.listing.complete())
        self.checked = True
        if self.resumes(resume_from_checkpoint, has_checkpoints) or not self.path.is_dir() or overwrite:
            return
        held = (
            "a trained model (model.safetensors)"
            if (self.path / "model.safetensors").exists()
            else "checkpoints of an unfinished run"
            if has_checkpoints
            else None
        )
        if held:
            raise UserError(
                f"--output-dir {self.path} already holds {held}"
                + (" and no checkpoint to resume" if resume_from_checkpoint == "latest" else "")
                + "; continue it with --resume-from-checkpoint latest, replace it with --overwrite-output-dir, or "
                "pick another --output-dir"
            )

    def resumes(self, resume_from_checkpoint: str | None, has_checkpoints: bool | None = None) -> bool:
        """Whether `--resume-from-checkpoint` continues a run: a path does; `latest` does when a complete checkpoint
        is here (`has_checkpoints`, looked up when None), and is a new run otherwise."""
        if resume_from_checkpoint is None:
            return False
        if resume_from_checkpoint != "latest":
            return True
        return bool(self.listing.complete()) if has_checkpoints is None else has_checkpoints

    def read_committed(self) -> dict[str, Any] | None:
        """metrics.json as the last commit wrote it; None when missing or unreadable."""
        try:
            committed = json.loads((self.path / COMMITTED).read_text())
        except (OSError, ValueError):
            return None
        return committed if isinstance(committed, dict) else None

    def committed_metrics(
        self,
        target: tuple[int, int],
        total_steps: int,
        identity: dict[str, Any],
        early_stopping: bool = True,
        time_budget: bool = False,
    ) -> dict[str, Any] | None:
        """The metrics of a run committed here under this identity that trained at least as far as `target`
        (epoch, samples into it: what a command asks for, in a unit that does not change with the world size, the
        batch size or the accumulation), or None. A run committed before it recorded its progress counts by
        `total_steps`. A committed run under another identity is refused. A run that early stopping ended is
        complete for a command with early stopping; without it, by its progress like any other."""
        committed = self.read_committed()
        if committed is None or not (self.path / "model.safetensors").is_file():
            return None
        if committed.get("identity") and identity:
            compare_identity(committed["identity"], identity, f"the run in {self.path}")
        if early_stopping and ended_by_early_stopping(committed):
            return committed  # it ended where its metric stopped improving: as far as it goes
        if time_budget and ended_by_the_time_budget(committed):  # as far as its budget went
            return committed
        progress = committed.get("progress")
        if isinstance(progress, dict):
            reached = (progress.get("epoch", -1), progress.get("samples_in_epoch", -1))
            return committed if reached >= target else None
        if not isinstance(committed.get("steps"), int) or committed["steps"] < total_steps:
            return None
        return committed

    def completion(
        self,
        target: tuple[int, int],
        total_steps: int,
        identity: dict[str, Any],
        early_stopping: bool,
        has_checkpoints: bool,
        time_budget: bool = False,
    ) -> tuple[dict[str, Any], str] | None:
        """A run committed here as far as a command asks for (`committed_metrics`): its metrics and the line that
        says so (what would continue it); None when there is none."""
        committed = self.committed_metrics(target, total_steps, identity, early_stopping, time_budget)
        if committed is None:
            return None
        if ended_by_early_stopping(committed) or ended_by_the_time_budget(committed):
            ended_by = "--early-stopping-patience" if ended_by_early_stopping(committed) else "--time-budget"
            how_on = f"Without {ended_by}, a larger --epochs or --max-steps"
            ended = f"ended by {committed['end_reason']}"
        else:
            how_on, ended = "A larger --epochs or --max-steps", f"{committed['steps']} steps"
        message = f"the run in {self.path} is complete ({ended}); nothing to do. " + (
            f"{how_on} continues it from its newest checkpoint."
            if has_checkpoints
            else "It kept no checkpoint to continue from (--checkpointing-steps): a longer run starts again, "
            "with --overwrite-output-dir."
        )
        return committed, message

    # --- while the run trains (main process) ---
    def lock(self, clear: bool = False) -> None:
        """Hold the folder until `release` (the process's exit releases it too); `clear`: the previous run's files
        go (clear_previous_run)."""
        self._lock = lock_output_dir(self.path)
        if clear:
            self.clear_previous_run()

    def release(self) -> None:
        """The run is over: the folder to the next run, which checks it again."""
        self.checked = False
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def clear_previous_run(self) -> None:
        """--overwrite-output-dir, once every check passed: the old run's checkpoints must not be resumed later, its
        curves and tracker runs not continued; its final artifacts are replaced at this run's commit."""
        shutil.rmtree(self.checkpoints, ignore_errors=True)
        self.listing.refresh()
        shutil.rmtree(self.path / "tensorboard", ignore_errors=True)
        shutil.rmtree(self.path / "failures", ignore_errors=True)
        for name in ("history.json", PREEMPTED_MARKER, TRACKER_RUNS, bad_samples.LOG):
            (self.path / name).unlink(missing_ok=True)

    def repeated_failure(self, rank: int, resumed_from: Path | None, step: int, error: BaseException) -> str | None:
        """A crash of this rank, noted in failures/rank_N.json. Returns the note of the earlier one when this crash
        repeats it: the same error, at the same step, after a resume from the same checkpoint. A restart would fail
        the same way again."""
        summary = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        note = {"resumed_from": str(resumed_from) if resumed_from else None, "step": step, "error": summary}
        path = self.path / "failures" / f"rank_{rank}.json"
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = None
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, note)
        return summary if earlier == note else None

    def refuse_a_repeated_crash(self, rank: int, resumed_from: Path | None, step: int, error: BaseException) -> None:
        """A crash that repeats from the same start (the same checkpoint, or none) at the same step is
        deterministic: a UserError, so that the launcher does not restart it again."""
        try:
            earlier = self.repeated_failure(rank, resumed_from, step, error)
        except (OSError, UserError):  # the output dir cannot take the note: the crash's own error is what matters
            with contextlib.suppress(OSError):
                (self.path / "failures").rmdir()  # (left only when empty)
            return
        if earlier is not None:
            start = f"resuming from {resumed_from}" if resumed_from else "starting from the beginning"
            raise UserError(
                f"the run failed at step {step} with the same error the last two times, each after {start} "
                f"({earlier}; the traceback is in the earlier attempt's log): a restart would fail the same way, so "
                "it stops here. Fix the cause, then continue with --resume-from-checkpoint latest",
                every_process=True,
            ) from error

    def stage_best(self, weights: dict[str, torch.Tensor]) -> None:
        """model_best.safetensors, staged until the commit (written aside, renamed)."""
        self.stage_weights("model_best.safetensors", weights)

    def stage_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        """A weights file staged until the commit (written aside, renamed)."""
        partial = self.staging / (name + ".partial")
        with writing(partial, cleanup=partial):  # a full disk: one line, the partial file gone
            self.staging.mkdir(parents=True, exist_ok=True)
            save_file({key: value.detach().contiguous().cpu() for key, value in weights.items()}, str(partial))
            os.replace(partial, self.staging / name)

    # --- the end ---
    def commit(self, final_model: Path, files: dict[str, Path], metrics: dict[str, Any]) -> None:
        """Move the final model's files, the staged ones and `files` (name -> source, copied) into place, then
        metrics.json (last: the run is complete) and drop the preemption marker (this run reached its end)."""
        for name, source in files.items():
            shutil.copyfile(source, self.staging / name)
        for file in list(final_model.iterdir()) + [path for path in self.staging.iterdir() if path.is_file()]:
            os.replace(file, self.path / file.name)
        final_model.rmdir()
        self.staging.rmdir()
        if not any(self.checkpoints.iterdir()):  # a run without checkpoints leaves no empty folder
            self.checkpoints.rmdir()
        write_json(self.path / COMMITTED, metrics)
        (self.path / PREEMPTED_MARKER).unlink(missing_ok=True)
        shutil.rmtree(self.path / "failures", ignore_errors=True)  # the crashes this run came through
