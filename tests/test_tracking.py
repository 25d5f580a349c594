"""--report-to: TensorBoard, MLflow and W&B (offline) through Accelerate's trackers, one run across a kill and
resume: the stored histories are read back from each tracker's own files."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import BIN, ROOT, assert_clean_error, rank_of, run_script, workers

from ddp_accel import tracking
from ddp_accel.errors import UserError

needs_trackers = pytest.mark.skipif(
    not (tracking.installed("mlflow") and tracking.installed("wandb")),
    reason="mlflow and wandb not installed: pip install -e .[tracking]",
)


def tensorboard_steps(directory: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for events in sorted(directory.glob("events.out.tfevents.*")):  # one file per process start, in time order
        for event in EventFileLoader(str(events)).Load():
            if any(value.tag == tag for value in event.summary.value):
                steps.append(event.step)
    return steps


def tensorboard_values(directory: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    values = []
    for events in sorted(directory.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(events)).Load():
            for value in event.summary.value:
                if value.tag == tag:
                    values.append(
                        float(tensor_util.make_ndarray(value.tensor))
                        if value.HasField("tensor")
                        else value.simple_value
                    )
    return values


def wandb_records(run_file: Path) -> list[bytes]:
    """The records of a W&B .wandb file: a 7-byte header (':W&B', magic, version), then LevelDB-log framing
    (32 KiB blocks; each chunk: crc32c, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4)."""
    data, position, records, pending = run_file.read_bytes(), 7, [], b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # block padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
        elif kind == 0:
            position += left - 7 - length
    return records


def wandb_history_steps(run_file: Path) -> list[int]:
    from wandb.proto import wandb_internal_pb2

    steps = []
    for data in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            if "train_loss" in items:
                steps.append(int(json.loads(items["_step"])))
    return steps


@needs_trackers
@pytest.mark.multiprocess
def test_every_tracker_keeps_one_run_across_a_kill_and_resume(tmp_path):
    output_dir = tmp_path / "run"
    command = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        "--monitor_interval",
        "0.2",
        str(ROOT / "tests" / "probe.py"),
        "--output-dir",
        str(output_dir),
        "--batch-size",
        "4",
        "--train-size",
        "256",
        "--epochs",
        "2",
        "--step-ms",
        "30",
        "--log-steps",
        "1",
        "--checkpointing-steps",
        "10",
        "--report-to",
        "all",
        "--resume-from-checkpoint",
        "latest",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": "",
        "DDP_ACCEL_CURVES": "1",  # logged as an artifact below
    }
    env.pop("MLFLOW_TRACKING_URI")
    log = open(tmp_path / "torchrun.log", "w")
    agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.monotonic() + 180
    # a few log steps past the checkpoint of step 10, then a worker dies; the agent restarts the group
    while tracking.read_state(output_dir).get("last_logged_samples", 0) < 14 * 8:  # the x axis: samples trained
        assert time.monotonic() < deadline and agent.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
        time.sleep(0.02)
    logged_before_kill = tracking.read_state(output_dir)["last_logged_samples"] // 8
    # rank 1 dies: the main process (the one that talks to the trackers) ends through its error path, so that
    # W&B, which buffers in a process of its own, writes what it holds (a SIGKILLed main process loses that part)
    rank1 = next(pid for pid in workers(agent) if rank_of(pid) == 1)
    os.kill(rank1, signal.SIGKILL)
    assert agent.wait(timeout=240) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    text = (tmp_path / "torchrun.log").read_text()
    assert "resumed from" in text and "step 10," in text, text[-3000:]
    total = 64  # 256 samples / (2 x 4) = 32 steps an epoch, 2 epochs
    state = tracking.read_state(output_dir)
    assert state["last_logged_samples"] == total * 8

    # TensorBoard: one directory, a file per process start, every step once, in order (at 8 samples a step)
    steps = [samples // 8 for samples in tensorboard_steps(output_dir / "tensorboard", "train_loss")]
    assert steps == list(range(1, total + 1)), steps
    assert sorted(set(tensorboard_values(output_dir / "tensorboard", "optimizer_step"))) == list(range(1, total + 1))
    assert len(list((output_dir / "tensorboard").glob("events.out.tfevents.*"))) >= 2

    # MLflow: one run in the experiment, its metric history every step once
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{output_dir.resolve()}/mlflow.db")
    experiment = client.get_experiment_by_name("probe")
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [state["mlflow_run_id"]]
    history = sorted(metric.step // 8 for metric in client.get_metric_history(state["mlflow_run_id"], "train_loss"))
    assert history == list(range(1, total + 1)), history
    assert runs[0].data.params["report_to"] == "all"
    artifacts = {item.path for item in client.list_artifacts(state["mlflow_run_id"])}
    assert {"model.safetensors", "training_curves.png"} <= artifacts

    # W&B offline: two run directories (one per start) under the same run id, steps never repeated
    run_dirs = sorted((output_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.endswith(state["wandb_run_id"]) for d in run_dirs), run_dirs
    wandb_steps = [step // 8 for d in run_dirs for step in wandb_history_steps(next(d.glob("*.wandb")))]
    # no step twice, never backwards, the resumed part complete; what the killed group's W&B service process had
    # not yet written is lost with it (it is in the workers' process group, which torch elastic signals)
    assert wandb_steps == sorted(set(wandb_steps)) and wandb_steps[-1] == total, wandb_steps
    assert set(range(logged_before_kill + 1, total + 1)) <= set(wandb_steps), wandb_steps
    print(
        f"\nkilled after step {logged_before_kill} was logged; resumed from step 10; TensorBoard and MLflow hold "
        f"steps 1..{total} once, W&B steps {wandb_steps[0]}..{total} once",
        file=sys.stderr,
    )


@pytest.mark.inprocess
def test_a_missing_tracker_package_is_one_line_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "installed", lambda name: name == "tensorboard")
    with pytest.raises(
        UserError, match=r"--report-to mlflow: the mlflow package is not installed; pip install -e \.\[tracking\]"
    ):
        tracking.tracker_names("mlflow")
    assert tracking.tracker_names("all") == ["tensorboard"]  # all: every installed tracker
    assert tracking.tracker_names("none", with_tracking=True) == ["tensorboard"]
    result = run_script("tests/probe.py", "--report-to", "neptune", "--output-dir", tmp_path)
    assert_clean_error(result, "--report-to", "invalid choice: 'neptune'")


@needs_trackers
@pytest.mark.inprocess
def test_a_tracker_that_would_fail_at_its_first_log_is_one_line_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)

    def minimal(output_dir, *args, env=None):
        return run_script("scripts/minimal.py", "--output-dir", output_dir, *args, env=env)

    result = minimal(tmp_path / "wandb", "--report-to", "wandb")
    assert_clean_error(result, "--report-to wandb: not logged in", "wandb login", "WANDB_MODE=offline")
    assert not (tmp_path / "wandb").exists()  # nothing trained, nothing written
    (tmp_path / "file").write_text("x")
    unwritable = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/file/mlflow.db"}
    result = minimal(tmp_path / "store", "--report-to", "mlflow", env=unwritable)
    assert_clean_error(result, "--report-to mlflow: the MLflow store", "cannot be written", "not a folder")
    started = time.monotonic()
    result = minimal(tmp_path / "server", "--report-to", "mlflow", env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert_clean_error(result, "the MLflow server http://127.0.0.1:9 does not answer")
    assert time.monotonic() - started < 30 and not (tmp_path / "server").exists()


@needs_trackers
@pytest.mark.inprocess
def test_a_restart_before_the_first_checkpoint_logs_each_step_once(tmp_path, monkeypatch):
    # killed before its first checkpoint, the run starts again from step 0: a new tracker run, not the first steps
    # logged twice into the old one (MLflow: steps 5, 5, 10, ...)
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    args = ["scripts/minimal.py", "--output-dir", out, "--report-to", "mlflow", "--resume-from-checkpoint", "latest"]
    run_script(*args)
    for name in ("model.safetensors", "metrics.json"):  # as if killed after its logs, before any checkpoint
        (out / name).unlink()
    run_script(*args)
    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve()}/mlflow.db")
    runs = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    for run in runs:
        steps = [metric.step for metric in client.get_metric_history(run.info.run_id, "train_loss")]
        assert steps == sorted(set(steps)), steps
    assert len(runs) == 2
