"""Experiment tracking through Accelerate's own trackers (`--report-to tensorboard|mlflow|wandb|all|none`), as one
run across interruptions: a resumed, restarted or requeued run continues the same TensorBoard directory, MLflow
run and W&B run, and never logs a step twice. The x axis is the samples trained (it only grows, also across a
resize, when optimizer steps are counted again in steps of another global batch).

Everything is kept in the output dir: OUTPUT_DIR/tensorboard/, OUTPUT_DIR/mlflow.db (+ mlartifacts/) unless
MLFLOW_TRACKING_URI says otherwise, OUTPUT_DIR/wandb/, and OUTPUT_DIR/tracking.json (the run ids and the last
logged place, in samples).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from ddp_accel.errors import UserError
from ddp_accel.files import write_json

TRACKERS = ("tensorboard", "mlflow", "wandb")
TRACKER_RUNS = "tracking.json"


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def tracker_names(report_to: str = "none", with_tracking: bool = False) -> list[str]:
    """The trackers to use; `all` is every installed one (as in Accelerate); a missing package is one line."""
    names = (
        [name for name in TRACKERS if installed(name)]
        if report_to == "all"
        else []
        if report_to in ("none", None)
        else [report_to]
    )
    if with_tracking and "tensorboard" not in names:  # the TensorBoard shortcut
        names.insert(0, "tensorboard")
    for name in names:
        if name not in TRACKERS:
            raise UserError(f"--report-to {name}: unknown tracker; use one of {', '.join(TRACKERS)}, all or none")
        if not installed(name):
            raise UserError(
                f"--report-to {name}: the {name} package is not installed; "
                f"pip install -e .[tracking] (or pip install {name})"
            )
    return names


def check_trackers(names: list[str], output_dir: str | Path, timeout_s: float = 10.0) -> None:
    """What would make a tracker fail at its first log, after the first steps were trained, said before training:
    W&B without a login, an MLflow store that cannot be written or a server that does not answer within
    `timeout_s`. Each line names the tracker and its remedy."""
    if "wandb" in names and os.environ.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun"):
        if not _wandb_key():
            raise UserError(
                "--report-to wandb: not logged in to W&B (no WANDB_API_KEY, no key in ~/.netrc); run `wandb login`, "
                "or set WANDB_MODE=offline to log into OUTPUT_DIR/wandb and `wandb sync` later"
            )
    if "mlflow" in names:
        _check_mlflow(os.environ.get("MLFLOW_TRACKING_URI") or _default_mlflow_uri(output_dir), timeout_s)


def _wandb_key() -> str | None:
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        found = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return found[2] if found else None


def _default_mlflow_uri(output_dir: str | Path) -> str:
    return f"sqlite:///{Path(output_dir).resolve()}/mlflow.db"


def _check_mlflow(uri: str, timeout_s: float) -> None:
    import urllib.error
    import urllib.request

    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise UserError(
                f"--report-to mlflow: the MLflow server {uri} does not answer within {timeout_s:g} s ({reason}); "
                "start it, or unset MLFLOW_TRACKING_URI to log into OUTPUT_DIR/mlflow.db"
            ) from None
        return
    store = Path(uri.removeprefix("sqlite:///").removeprefix("file://"))
    folder = store.parent if uri.startswith("sqlite:") else store
    existing = next((path for path in [folder, *folder.parents] if path.exists()), Path("/"))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"--report-to mlflow: the MLflow store {uri} cannot be written ({existing} is "
            f"{'not a folder' if not existing.is_dir() else 'not writable'}); set MLFLOW_TRACKING_URI to a writable "
            "place, or unset it to log into OUTPUT_DIR/mlflow.db"
        )


def read_state(output_dir: str | Path) -> dict[str, Any]:
    path = Path(output_dir) / TRACKER_RUNS
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def make_trackers(names: list[str], output_dir: str | Path, resuming: bool) -> list:
    """Accelerate tracker objects (started later by `init_trackers`), continuing the runs recorded in the output dir
    when this run resumes."""
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

    output_dir = Path(output_dir).resolve()
    state = read_state(output_dir) if resuming else {}
    project = Path(sys.argv[0]).stem or "ddp_accel"  # the script's name: imdb, imagenet, template...
    trackers = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker("tensorboard", str(output_dir)))  # OUTPUT_DIR/tensorboard
        elif name == "mlflow":
            # MLflow's default store is ./mlruns in the current directory; Accelerate does not set one
            os.environ.setdefault("MLFLOW_TRACKING_URI", _default_mlflow_uri(output_dir))
            trackers.append(
                MLflowTracker(project, logging_dir=str(output_dir / "mlartifacts"), run_id=state.get("mlflow_run_id"))
            )
        elif name == "wandb":
            run_id = state.get("wandb_run_id") or uuid.uuid4().hex[:12]
            trackers.append(WandBTracker(project, id=run_id, resume="allow", dir=str(output_dir)))
    return trackers


class TrackerLog:
    """Logs to every tracker of the Accelerator, skipping the steps a resumed run redoes (they were logged before
    the interruption with the very same values: resume is exact). The trackers start at the first log, after the
    first optimizer step: a command that fails before it leaves no tracker files behind."""

    def __init__(
        self, accelerator: Any, output_dir: str | Path, hyperparameters: dict[str, Any], resumed: bool
    ) -> None:
        self.accelerator, self.output_dir, self.hyperparameters = accelerator, Path(output_dir), hyperparameters
        self.state = read_state(output_dir) if resumed else {}
        # logged before this process started, in samples trained (a file of an earlier version counted steps)
        self.horizon = self.state.get("last_logged_samples", -1)
        self.last = self.horizon
        self.started = False

    def _start(self) -> None:
        self.started = True
        accelerator = self.accelerator
        try:
            accelerator.init_trackers(Path(sys.argv[0]).stem or "ddp_accel")
        except Exception as error:  # what check_trackers could not foresee: one line naming the trackers
            names = ", ".join(str(getattr(tracker, "name", tracker)) for tracker in self.accelerator.log_with)
            raise UserError(
                f"cannot start the {names} tracker(s): "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
                + (" (W&B: `wandb login`, or WANDB_MODE=offline)" if "wandb" in names else "")
            ) from None
        for tracker in accelerator.trackers:
            if not (tracker.name == "mlflow" and self.state.get("mlflow_run_id")):  # MLflow refuses changed params
                tracker.store_init_configuration(self.hyperparameters)
        self._save_state()

    @property
    def active(self) -> bool:
        """Some tracker is configured (the same answer on every rank)."""
        return bool(self.accelerator.log_with)

    def log(self, values: dict[str, Any], step: int) -> None:
        """`step`: the x axis, samples trained."""
        if not self.active or step <= self.horizon:
            return
        if not self.started:
            self._start()
        self.accelerator.log(values, step=step)
        for tracker in self.accelerator.trackers:  # TensorBoard buffers up to 2 minutes: on disk before we note it
            if tracker.name == "tensorboard" and self.accelerator.is_main_process:
                tracker.writer.flush()
        if step > self.last:
            self.last = step
            self._save_state()

    def finish(self, artifacts: list[Path]) -> None:
        """MLflow also keeps the final files (model.safetensors, training_curves.png) as artifacts."""
        if not self.started:
            return
        for tracker in self.accelerator.trackers:
            if tracker.name == "mlflow" and self.accelerator.is_main_process:
                import mlflow

                for path in artifacts:
                    if path.is_file():
                        mlflow.log_artifact(str(path))
            tracker.finish()

    def _save_state(self) -> None:
        if not self.accelerator.is_main_process:
            return
        state = {"last_logged_samples": self.last}
        for tracker in self.accelerator.trackers:
            if tracker.name == "mlflow":
                state["mlflow_run_id"] = tracker.active_run.info.run_id
            elif tracker.name == "wandb":
                state["wandb_run_id"] = tracker.run.id
        write_json(self.output_dir / TRACKER_RUNS, state)
