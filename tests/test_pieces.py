"""The pieces of the loop, each on its own with small fakes or a one-process CPU Accelerator: the stop agreement,
the checkpoint policy and choice, the run folder's lifecycle, the throughput meter, the position after a resume at
another world size, the stop's facts and marker, and the callbacks a feature hooks in with."""

import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader, TensorDataset

from ddp_accel import Callback, Task, TrainConfig, UserError, allocator, fit, make_accelerator
from ddp_accel.agreement import StepAgreement
from ddp_accel.checkpoint import Checkpoints
from ddp_accel.meters import ThroughputMeter
from ddp_accel.run_folder import RunFolder
from ddp_accel.state import RunIdentity, TrainState
from ddp_accel.stopping import PREEMPTED_MARKER, Phase, Preempted, StopFacts

pytestmark = pytest.mark.inprocess


@pytest.fixture
def accelerator():
    accelerator = Accelerator(cpu=True)
    yield accelerator
    AcceleratorState._reset_state(reset_partial_state=True)


# --- the agreement on stopping (one process: no all-reduce, the flags themselves) ---
def fake_accelerator(scale: float | None = None, process_index: int = 0):
    scaler = SimpleNamespace(get_scale=lambda: scale) if scale is not None else None
    return SimpleNamespace(
        device=torch.device("cpu"), process_index=process_index, optimizer_step_was_skipped=False, scaler=scaler
    )


def test_the_agreement_says_stop_for_a_nonfinite_loss_or_a_signal_and_nothing_otherwise():
    agreement = StepAgreement(fake_accelerator())
    agreement.observe(torch.tensor(0.5))
    assert agreement.step_done(1, None) is None
    agreement.observe(torch.tensor(math.nan))
    agreement.observe(torch.tensor(0.5))  # a later finite micro-batch does not clear the step's flag
    verdict = agreement.step_done(2, None)
    assert verdict is not None and verdict.nonfinite and verdict.step == 2 and verdict.signal is None
    assert agreement.step_done(3, None) is None  # the flag belongs to its step
    verdict = agreement.step_done(4, int(signal.SIGUSR1))
    assert verdict is not None and verdict.signal == "SIGUSR1" and not verdict.nonfinite
    assert agreement.preempted(4, int(signal.SIGTERM)).signal == "SIGTERM"
    assert agreement.preempted(4, None) is None


def test_under_fp16_an_overflow_is_the_scalers_business_until_the_scale_falls_below_one():
    agreement = StepAgreement(fake_accelerator(scale=1024.0))
    agreement.observe(torch.tensor(math.inf))
    assert agreement.step_done(1, None) is None
    agreement = StepAgreement(fake_accelerator(scale=0.5))
    agreement.observe(torch.tensor(math.inf))
    assert agreement.step_done(1, None).nonfinite


def test_after_each_step_every_rank_holds_process_0s_batchnorm_statistics(monkeypatch):
    # each rank updates its norm layers' running statistics with its own batch, and a checkpoint keeps process
    # 0's: they travel in the step's agreement (a MAX all-reduce, -inf from the other ranks), so a survivor of a
    # lost process 0 can save them. The all-reduce here is two ranks' MAX, done in one process
    from ddp_accel import agreement as stopping

    def trained(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4))
        model(torch.randn(8, 3))
        return model

    models = [trained(0), trained(1)]  # each rank's statistics of its own batch
    agreements = []
    for rank, model in enumerate(models):
        agreement = StepAgreement(fake_accelerator(process_index=rank))
        agreement.streams = agreement.distributed = True  # (as with two processes)
        agreement.keep_buffers([model])
        agreements.append(agreement)
    sent: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, op) -> None:
        sent.append(tensor.clone())
        if len(sent) == 2:
            tensor.copy_(torch.maximum(*sent))

    monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
    assert agreements[0].step_done(7, None) is None and agreements[1].step_done(7, None) is None
    step, kept = agreements[1].submitted_buffers
    process_0 = dict(models[0].named_buffers())
    assert step == 7 and kept.keys() == {(0, name) for name in process_0}
    for name, buffer in process_0.items():
        assert kept[(0, name)].dtype == buffer.dtype and kept[(0, name)].equal(buffer), name
    assert not kept[(0, "1.running_mean")].equal(models[1][1].running_mean)  # (the ranks' own differed)
    assert agreements[1].agreed_streams[2]  # the flags and the streams' digest travel as before
    models[0][1].running_mean.add_(1.0)  # the next step's forward: the kept copies stay the step's
    assert not kept[(0, "1.running_mean")].equal(models[0][1].running_mean)


# --- the checkpoints: policy, what is complete, latest, rotation, loading under the run's identity ---
def test_the_checkpoint_policy_saves_every_n_steps_or_at_epoch_ends(tmp_path, accelerator):
    every_5 = Checkpoints(accelerator, tmp_path, every=5)
    assert [step for step in range(1, 16) if every_5.due_at_step(step)] == [5, 10, 15]
    assert not every_5.due_at_epoch_end()
    at_epochs = Checkpoints(accelerator, tmp_path, every="epoch")
    assert at_epochs.due_at_epoch_end() and not any(at_epochs.due_at_step(step) for step in range(1, 16))
    never = Checkpoints(accelerator, tmp_path)
    assert not never.due_at_epoch_end() and not any(never.due_at_step(step) for step in range(1, 16))


def test_checkpoints_rotate_by_training_progress_and_load_only_under_the_same_identity(tmp_path, accelerator):
    from ddp_accel.checkpoint_format import AcceleratorObjects, Contents

    model = accelerator.prepare(torch.nn.Linear(2, 2))
    identity = RunIdentity("Linear:abc", {"options": {"hidden": 4}, "versions": {}})
    contents = Contents(AcceleratorObjects([model]))
    checkpoints = Checkpoints(accelerator, tmp_path / "checkpoints", every=1, limit=2, contents=contents)
    assert checkpoints.resolve("latest") is None and checkpoints.complete() == []
    for step in (1, 2, 3):
        state = TrainState(step=step, batches_in_epoch=step, global_batch=4)
        checkpoints.save(state, identity)
        assert checkpoints.holds(state, identity)
    assert [path.name for path in checkpoints.complete()] == ["step_2", "step_3"]  # the oldest rotated out
    assert not checkpoints.holds(TrainState(step=3, batches_in_epoch=2, global_batch=4), identity)
    latest = checkpoints.resolve("latest")
    assert latest == tmp_path / "checkpoints" / "step_3"

    loaded = TrainState()
    with torch.no_grad():
        model.weight.zero_()
    assert checkpoints.load(latest, loaded, identity) == []
    assert loaded.step == 3 and loaded.global_batch == 4 and model.weight.abs().sum() > 0
    with pytest.raises(UserError, match="written by another model"):
        checkpoints.load(latest, TrainState(), RunIdentity("Linear:other", identity.identity))
    other_options = RunIdentity("Linear:abc", {"options": {"hidden": 8}, "versions": {}})
    with pytest.raises(UserError, match="--hidden was 4, now 8"):
        checkpoints.load(latest, TrainState(), other_options)
    with pytest.raises(UserError, match="no such checkpoint"):
        checkpoints.resolve(str(tmp_path / "missing"))


# --- the run's folder ---
def test_the_folder_check_refuses_to_replace_a_trained_run_and_lets_a_resume_through(tmp_path):
    with pytest.raises(UserError, match="is empty"):
        RunFolder("").check(None, overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        RunFolder(tmp_path / "file").check(None, overwrite=False)
    folder = RunFolder(tmp_path / "run")
    folder.check(None, overwrite=False)  # a new folder
    folder.path.mkdir()
    (folder.path / "model.safetensors").write_text("weights")
    with pytest.raises(UserError, match="already holds a trained model"):
        folder.check(None, overwrite=False)
    folder.check(None, overwrite=True)
    folder.check("latest", overwrite=False)  # the early check: fit tells a complete run from one to refuse
    with pytest.raises(UserError, match="and no checkpoint to resume"):
        folder.check("latest", overwrite=False, has_checkpoints=False)
    folder.check("latest", overwrite=False, has_checkpoints=True)


def test_the_folder_is_locked_by_one_run_and_commits_its_artifacts_with_the_metrics_last(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.lock()
    with pytest.raises(UserError, match="in use by another run"):
        RunFolder(tmp_path / "run").lock()
    folder.release()
    other = RunFolder(tmp_path / "run")
    other.lock()
    other.release()

    StopFacts(Phase.TRAIN, "SIGTERM", 7, "somewhere", 0.5).write(folder.path)
    folder.stage_best({"weight": torch.ones(2)})
    final = folder.staging / "model"
    final.mkdir()
    (final / "model.safetensors").write_text("weights")
    (tmp_path / "vocab.json").write_text("{}")
    assert folder.committed_metrics((2, 0), 10, {}) is None
    progress = {"epoch": 2, "samples_in_epoch": 0}
    folder.commit(final, {"vocab.json": tmp_path / "vocab.json"}, {"steps": 10, "progress": progress})
    names = {path.name for path in folder.path.iterdir()}
    assert names == {"model.safetensors", "model_best.safetensors", "vocab.json", "metrics.json"}, names
    assert folder.committed_metrics((2, 0), 10, {})["steps"] == 10
    assert folder.committed_metrics((2, 0), 20, {}) is not None  # 2 epochs, whatever the steps counted
    assert folder.committed_metrics((2, 8), 11, {}) is None  # a longer run is not complete


def test_a_committed_run_under_another_identity_is_refused(tmp_path):
    folder = RunFolder(tmp_path)
    (tmp_path / "model.safetensors").write_text("weights")
    saved = {"options": {"arch": "resnet18"}, "versions": {}}
    (tmp_path / "metrics.json").write_text(json.dumps({"steps": 5, "identity": saved}))
    assert folder.committed_metrics((1, 0), 5, saved)["steps"] == 5  # an earlier version's metrics: by steps
    assert folder.committed_metrics((1, 0), 6, saved) is None
    with pytest.raises(UserError, match="--arch was 'resnet18', now 'resnet50'"):
        folder.committed_metrics((1, 0), 5, {"options": {"arch": "resnet50"}, "versions": {}})


def test_a_recipe_turned_on_or_off_at_a_resume_is_refused_and_an_unused_one_is_not_recorded():
    # recipes are recorded only when used (older runs resume): one turned on at a resume was let through
    from ddp_accel.identity import compare_identity, make_identity

    unset = {"mixup_alpha": 0.0, "auto_augment": "none"}
    plain = make_identity({"arch": "resnet18", "mixup_alpha": 0.0, "auto_augment": "none"}, unset=unset)
    mixed = make_identity({"arch": "resnet18", "mixup_alpha": 0.2, "auto_augment": "none"}, unset=unset)
    assert plain["options"] == {"arch": "resnet18"} and mixed["options"] == {"arch": "resnet18", "mixup_alpha": 0.2}
    older = {"options": {"arch": "resnet18"}, "versions": {}}  # a run from before the recipes existed
    assert compare_identity(older, plain, "checkpoint x") is None
    with pytest.raises(UserError, match=r"--mixup-alpha was not given \(0.0\), now 0.2"):
        compare_identity(older, mixed, "checkpoint x")
    with pytest.raises(UserError, match="--mixup-alpha was 0.2, now 0.0"):
        compare_identity(mixed, plain, "checkpoint x")


# --- the meter, the position after a resume, the stop's facts ---
def test_the_throughput_meter_reports_windows_and_the_steady_rate_after_the_first():
    meter = ThroughputMeter()
    meter.add(100, step_time=1.0, data_wait=0.5)  # the first window: start-up, slow
    assert meter.window() == (100.0, 0.5)
    for _ in range(4):
        meter.add(100, step_time=0.25, data_wait=0.0)
    assert meter.window() == (400.0, 0.0)
    summary = meter.summary()
    assert summary["train_samples"] == 500 and summary["train_samples_per_s"] == 250.0
    assert summary["steady_samples_per_s"] == 400.0 and summary["steady_data_wait_share"] == 0.0
    # the start-up: from this process's start to its first step (not to the last one, nor from the meter's creation)
    age = time.time() - psutil.Process().create_time()
    assert summary["startup_s"] < age + 1.0 and summary["startup_s"] > age - 5.0
    assert ThroughputMeter().summary()["startup_s"] is None
    # its phases: the moments marked before the first batch, in their order; the batch came after the first step's
    # wait for data (0.5 s of its 1.0 s), the step's end 0.5 s later
    phases = summary["startup_phases"]
    assert list(phases)[-2:] == ["first_batch", "first_step"] and phases["first_step"] == pytest.approx(
        summary["startup_s"], abs=0.002
    )
    assert phases["first_step"] - phases["first_batch"] == pytest.approx(0.5, abs=0.002)
    assert list(phases.values()) == sorted(phases.values())


def test_the_start_up_s_moments_are_marked_in_their_order_from_the_process_s_start(tmp_path):
    script = (
        "import time\nfrom ddp_accel import startup\n"
        "startup.mark('a'); startup.mark('b'); time.sleep(0.05); startup.mark('a'); time.sleep(0.05)\n"
        "batch = time.time()\n"
        "startup.mark('after the batch'); print(startup.process_started_at(), startup.startup_phases(batch, batch + 1))"
    )
    before = time.time()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    started, phases = result.stdout.split(" ", 1)
    # the kernel's start time of the process, to its clock tick (psutil's is off by up to a second)
    assert before - 0.02 <= float(started) <= before + 1.0
    phases = eval(phases)  # noqa: S307  (a dict the child printed)
    # in the order reached (a moment marked again counts at its last time), none after the first batch
    assert list(phases) == ["b", "a", "first_batch", "first_step"] and phases["a"] - phases["b"] >= 0.045
    assert phases["first_step"] - phases["first_batch"] == pytest.approx(1.0, abs=0.002)


def test_a_resume_at_twice_the_global_batch_continues_from_the_same_sample():
    # 1 process x batch 4 stopped 16 samples into epoch 2 of 16 batches; 2 processes x 4: 8 batches an epoch
    state = TrainState(step=20, epoch=1, batches_in_epoch=4, global_batch=4, world_size=1)
    rebase = state.rebase(global_batch=8, world_size=2, batches_per_epoch=8, accumulation=1)
    assert (rebase.saved_step, rebase.saved_batch, rebase.skip, rebase.leftover) == (20, 4, 2, 0)
    assert (state.step, state.batches_in_epoch, state.samples_in_epoch, state.world_size) == (10, 2, 16, 2)
    odd = TrainState(step=3, epoch=0, batches_in_epoch=3, global_batch=4)  # 12 samples: 1 batch of 8, 4 seen again
    assert odd.rebase(8, 2, 8, 1).leftover == 4 and odd.step == 1
    accumulated = TrainState(step=5, epoch=0, batches_in_epoch=5, global_batch=4)  # accumulation 1 -> 2
    accumulated.rebase(4, 1, batches_per_epoch=16, accumulation=2)
    assert accumulated.step == 2 and accumulated.batches_in_epoch == 5


def test_what_counts_steps_follows_a_recount_the_best_step_and_the_ema_warmup():
    from ddp_accel.ema import WeightAverage

    state = TrainState(step=20, epoch=1, batches_in_epoch=4, global_batch=4, best_step=12)
    rebase = state.rebase(global_batch=8, world_size=2, batches_per_epoch=8, accumulation=1)
    assert rebase.recounted and (rebase.step, state.best_step) == (10, 6)  # 48 samples: step 6 of 8 samples
    average = WeightAverage(0.99, warmup=True)
    average.updates = 20  # one per optimizer step of the checkpoint's
    average.on_rebase(None, rebase)
    assert average.updates == 10  # --ema-warmup's decay (1 + t) / (10 + t) at this command's step
    same = TrainState(step=5, batches_in_epoch=5, global_batch=4).rebase(4, 1, 16, 1)
    assert not same.recounted and same.steps_now(5) == 5


def test_a_stop_writes_its_facts_once_and_carries_them(tmp_path):
    facts = StopFacts(Phase.EVAL, "SIGUSR1", 12, str(tmp_path / "step_12"), 1.25)
    facts.write(tmp_path)
    marker = json.loads((tmp_path / PREEMPTED_MARKER).read_text())
    assert marker["phase"] == "eval" and marker["step"] == 12 and marker["save_s"] == 1.25
    assert StopFacts.last_save_s(tmp_path) == 1.25 and StopFacts.last_save_s(tmp_path / "none") == 0.0
    preempted = Preempted(facts)
    assert not preempted.facts.before_training and "at step 12 (eval)" in preempted.message
    before = Preempted(StopFacts(Phase.STARTUP, "SIGTERM"))
    assert before.facts.before_training and "before training started" in before.message


# --- callbacks: the one way a feature hooks into the loop ---
class Recorder(Callback):
    """Records the hooks it sees, and keeps a count that must survive a resume (state_dict)."""

    def __init__(self):
        self.calls: list[str] = []
        self.steps_seen = 0

    def on_start(self, run):
        self.calls.append(f"start@{run.state.step}")

    def on_step_end(self, run):
        self.steps_seen += 1
        self.calls.append("step")

    def on_log(self, run, logs):
        self.calls.append("log")

    def on_evaluate(self, run, metrics):
        self.calls.append("evaluate")

    def on_checkpoint(self, run, path):
        self.calls.append(f"checkpoint:{Path(path).name}")

    def on_end(self, run, metrics):
        self.calls.append(f"end@{metrics['steps']}")

    def on_close(self, run):
        self.calls.append("close")

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = state["steps_seen"]


def small_task() -> Task:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    model = torch.nn.Linear(4, 2)

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    def eval_fn(model, batch):
        return {"loss": torch.nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")}

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Task(model, optimizer, DataLoader(data, batch_size=8, shuffle=True), loss_fn, DataLoader(data), eval_fn)


def fit_small(output_dir: Path, *callbacks: Callback, **options) -> dict:
    config = TrainConfig(output_dir=str(output_dir), epochs=2, log_steps=4, **options)
    try:
        return fit(make_accelerator(config), config, small_task(), callbacks=list(callbacks))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


class StepCounter(Callback):
    state_key = "counter"

    def __init__(self):
        self.count = 0

    def on_step_end(self, run):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_callback_states_are_saved_by_name_so_removing_or_adding_one_shifts_no_other(tmp_path, capsys):
    # saved by position (Accelerate's custom_checkpoint_N), a Recorder's state went to the counter once the
    # Recorder was removed
    fit_small(tmp_path / "run", Recorder(), StepCounter(), checkpointing_steps=3)
    for name in ("model.safetensors", "metrics.json"):
        os.remove(tmp_path / "run" / name)
    counter = StepCounter()
    fit_small(tmp_path / "run", counter, checkpointing_steps=3, resume_from_checkpoint="latest")
    assert counter.count == 6 + 2
    assert "holds the state of a callback this run does not have (Recorder): left unused" in capsys.readouterr().out
    for name in ("model.safetensors", "metrics.json"):
        os.remove(tmp_path / "run" / name)
    recorder, counter, fresh = Recorder(), StepCounter(), StepCounter()  # another order, and a new callback
    fresh.state_key = "fresh"
    fit_small(tmp_path / "run", counter, fresh, recorder, checkpointing_steps=3, resume_from_checkpoint="latest")
    assert (counter.count, recorder.steps_seen, fresh.count) == (6 + 2, 6 + 2, 2)
    assert "holds no state of the callback fresh: it starts afresh" in capsys.readouterr().out


def test_callbacks_see_every_hook_in_order_and_their_state_resumes(tmp_path):
    recorder = Recorder()
    fit_small(tmp_path / "run", recorder, checkpointing_steps=3)
    assert recorder.calls == [
        "start@0",
        *["step"] * 3,
        "checkpoint:step_3",
        "step",
        "log",  # step 4 (--log-steps 4)
        "evaluate",  # the end of epoch 1 (4 steps)
        *["step"] * 2,
        "checkpoint:step_6",
        *["step"] * 2,
        "log",
        "evaluate",
        "end@8",
        "close",
    ], recorder.calls
    # a resume from step_6 restores the callback's own state from the checkpoint
    for name in ("model.safetensors", "metrics.json"):
        os.remove(tmp_path / "run" / name)
    resumed = Recorder()
    fit_small(tmp_path / "run", resumed, checkpointing_steps=3, resume_from_checkpoint="latest")
    assert resumed.calls[0] == "start@6" and resumed.steps_seen == 6 + 2, resumed.calls


def test_the_best_model_is_the_highest_finite_value_and_a_nan_evaluation_never_is():
    import contextlib

    from ddp_accel.callbacks import BestModel

    staged = []
    run = SimpleNamespace(
        state=TrainState(),
        exported_model=lambda: None,
        ema=None,
        accelerator=SimpleNamespace(is_main_process=True, get_state_dict=lambda model: {"step": run.state.step}),
        folder=SimpleNamespace(stage_best=staged.append),
        slow_on_main=lambda what, happens=True: contextlib.nullcontext(),
    )
    best = BestModel("eval_top1")
    for step, value in ((1, math.nan), (2, 0.4), (3, 0.3), (4, math.nan), (5, 0.4), (6, 0.6)):
        run.state.step = step
        best.on_evaluate(run, {"eval_top1": value})
    assert (run.state.best_metric, run.state.best_step) == (0.6, 6) and staged == [{"step": 2}, {"step": 6}]
    lowest = BestModel("eval_loss")  # lower is better for a loss
    run.state = TrainState()
    for step, value in ((1, 0.9), (2, 0.7), (3, 0.8)):
        run.state.step = step
        lowest.on_evaluate(run, {"eval_loss": value})
    assert (run.state.best_metric, run.state.best_step) == (0.7, 2)


# --- the run's identity: data by content, never by modification times ---
def test_a_data_folder_is_fingerprinted_by_content_not_by_mtimes_and_leaves_the_output_dir_out(tmp_path):
    import shutil

    from ddp_accel.identity import compare_identity, make_identity, source_fingerprint

    data = tmp_path / "data"
    for split, name in (("train", "a.jpg"), ("train", "b.jpg"), ("val", "c.jpg")):
        (data / split).mkdir(parents=True, exist_ok=True)
        (data / split / name).write_bytes(name.encode() * 100)
    before = source_fingerprint(data)
    assert "(by content; train: 2 files, 1,000 bytes, " in before and "val: 1 files, 500 bytes, " in before
    shutil.copytree(data, tmp_path / "copy")  # new modification times, the same bytes
    os.utime(tmp_path / "copy" / "val" / "c.jpg", (1, 1))
    assert source_fingerprint(tmp_path / "copy") == before
    (data / "run" / "checkpoints").mkdir(parents=True)  # a run's output dir inside the data, and a hidden file
    (data / "run" / "checkpoints" / "training_state.json").write_text("{}")
    (data / ".DS_Store").write_text("x")
    assert source_fingerprint(data, exclude=[data / "run"]) == before
    (data / "val" / "c.jpg").write_bytes(b"C" * 500)  # the same size, another image
    assert source_fingerprint(data) != before
    changed_part = source_fingerprint(data)
    assert changed_part.split("train: ")[1][:40] == before.split("train: ")[1][:40]  # the refusal shows which part
    assert changed_part.split("val: ")[1] != before.split("val: ")[1]
    # a large dataset: every path and size, and the content of 1 file in k (here every 2nd: a.jpg and c.jpg)
    sampled = source_fingerprint(tmp_path / "copy", content_limit=1000)
    assert "paths, sizes and the content of 1 file in 2" in sampled
    (tmp_path / "copy" / "train" / "b.jpg").write_bytes(b"B" * 500)  # not sampled: unseen
    assert source_fingerprint(tmp_path / "copy", content_limit=1000) == sampled
    (tmp_path / "copy" / "val" / "c.jpg").write_bytes(b"C" * 500)  # sampled: seen
    assert source_fingerprint(tmp_path / "copy", content_limit=1000) != sampled

    # a checkpoint of an earlier version fingerprinted the folder with mtimes: a warning, not a refusal
    current = make_identity({"arch": "resnet18"}, {"data": data})
    old = {"options": {"arch": "resnet18", "data": "folder 053766a0a1b2c3d4e5f60718"}, "versions": current["versions"]}
    assert "--data by modification times" in compare_identity(old, current, "checkpoint step_5")
    with pytest.raises(UserError, match="--arch was 'resnet18', now 'resnet50'"):
        compare_identity(old, make_identity({"arch": "resnet50"}, {"data": data}), "checkpoint step_5")
    other = shutil.copytree(data, tmp_path / "other", ignore=shutil.ignore_patterns("c.jpg"))
    with pytest.raises(UserError, match=r"--data was .*val: 1 files, 500 bytes.*now .*go on knowingly"):
        compare_identity(current, make_identity({"arch": "resnet18"}, {"data": other}), "checkpoint step_5")


# --- the process's signals: Ctrl-C through a library's cleanup, and processes forked from ours ---
def test_an_error_raised_while_leaving_on_ctrl_c_is_still_the_interrupt(capsys):
    # datasets.map's pool, interrupted, fails its own join with a TimeoutError raised inside the KeyboardInterrupt
    from ddp_accel import run_main

    def main():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise TimeoutError("the pool's workers did not stop") from None

    with pytest.raises(SystemExit) as exit_:
        run_main(main)
    err = capsys.readouterr().err
    assert exit_.value.code == 130 and "interrupted (Ctrl-C)" in err and "Traceback" not in err, err


def test_a_child_forked_from_a_training_process_leaves_ctrl_c_to_its_parent():
    # Ctrl-C reaches the whole foreground process group: a datasets.map pool worker killed by it while holding the
    # pool's queue lock made the worker forked in its place wait forever, and the parent's exit with it
    from ddp_accel import StopSignals

    def forked_child_sigint():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, b"ignored" if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else b"handled")
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        return os.read(read, 16).decode()

    # from a terminal's state: a background job of a shell (`cmd &`) starts with Ctrl-C ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals():
            assert forked_child_sigint() == "ignored"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent still takes Ctrl-C
        assert forked_child_sigint() == "handled"  # outside a training process nothing changes
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_closed_terminal_sighup_stops_like_a_preemption_unless_started_under_nohup():
    from ddp_accel import StopSignals

    # from a terminal's state (the suite itself may run under nohup); to this thread: a signal to the process may
    # go to another thread of pytest's, and its handler run later
    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with StopSignals() as signals:
            signals.enter(Phase.TRAIN)
            signal.pthread_kill(threading.get_ident(), signal.SIGHUP)
            assert signals.received == signal.SIGHUP  # the loop's agreement saves and stops at the next step
    finally:
        signal.signal(signal.SIGHUP, inherited)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does
    try:
        with StopSignals() as signals:
            signals.enter(Phase.TRAIN)
            signal.pthread_kill(threading.get_ident(), signal.SIGHUP)
            assert signals.received is None and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_padding_of_an_epochs_last_round_is_counted():
    # 18 samples, 2 processes x 8: the second round holds 2 real samples and 14 from the epoch's start (measured
    # with tests/probe.py: 64 ids consumed in 2 epochs, 18 distinct); one process has a short last batch instead
    from ddp_accel.run_setup import padded_samples

    assert padded_samples(18, 16, 2) == 14 and padded_samples(18, 16, 1) == 0
    assert padded_samples(40, 8, 2) == 0 and padded_samples(0, 8, 2) == 0  # a dataset without a length: unknown


def test_mixed_precision_auto_takes_bf16_only_where_it_is_fast(monkeypatch):
    # the documented CIFAR command asked for bf16: on an AVX2-only CPU that is emulated (16 samples/s instead of
    # ~210 in fp32); auto picks what this device computes natively
    from ddp_accel import runtime

    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: False)
    assert runtime.resolve_mixed_precision("auto", cpu=True)[0] == "no"
    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: True)
    assert runtime.resolve_mixed_precision("auto", cpu=True)[0] == "bf16"
    assert runtime.resolve_mixed_precision("bf16", cpu=True) == ("bf16", "")  # asked for: kept (the banner warns)
    assert runtime.resolve_mixed_precision(None, cpu=True) == (None, "")  # the accelerate config decides


def test_bf16_counts_as_fast_only_on_a_cpu_with_its_instructions():
    # oneDNN says bf16 is supported on any AVX-512 CPU: an AVX-512 Xeon without AVX512-BF16/AMX emulates it, 2.3x
    # slower than fp32 for the CIFAR command (measured), and `auto` took bf16 there
    from ddp_accel.runtime import fast_bf16

    xeon_avx512 = frozenset("sse4_2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni".split())
    epyc_amx = xeon_avx512 | {"avx512_bf16", "amx_bf16", "amx_tile"}
    epyc_avx2 = frozenset("sse4_2 avx avx2 fma".split())
    assert not fast_bf16(True, "x86_64", xeon_avx512, None)
    assert fast_bf16(True, "x86_64", epyc_amx, None)
    assert fast_bf16(True, "x86_64", xeon_avx512 | {"avx512_bf16"}, None)
    assert not fast_bf16(False, "x86_64", epyc_avx2, None)  # oneDNN itself says no
    assert not fast_bf16(True, "x86_64", None, None)  # flags unreadable: fp32, never the 2-13x slower guess
    assert not fast_bf16(True, "x86_64", epyc_amx, "AVX2")  # oneDNN capped below its bf16 instructions
    assert not fast_bf16(True, "x86_64", epyc_amx, "avx512_core")
    assert fast_bf16(True, "x86_64", epyc_amx, "AVX512_CORE_AMX") and fast_bf16(True, "x86_64", epyc_amx, "all")
    assert fast_bf16(True, "aarch64", frozenset({"fp", "asimd", "bf16"}), None)  # Arm: oneDNN's check decides
    assert not fast_bf16(False, "aarch64", frozenset({"fp", "asimd"}), None)


def test_each_lr_schedule_has_its_shape_and_the_image_scripts_schedules_are_unchanged():
    import math

    from ddp_accel import TrainConfig
    from ddp_accel.schedules import LearningRateSchedule

    def factors(steps=range(0, 101), **options):
        schedule = LearningRateSchedule(TrainConfig(lr=0.1, **options), total_steps=100, steps_per_epoch=10)
        return [schedule(step) for step in steps]

    step = factors(lr_schedule="step", lr_step_epochs=3)
    assert step[29] == 1 and step[30] == pytest.approx(0.1) and step[60] == pytest.approx(0.01)
    multistep = factors(lr_schedule="multistep", lr_milestones=[5, 2], lr_gamma=0.5)
    assert multistep[19] == 1 and multistep[20] == 0.5 and multistep[49] == 0.5 and multistep[50] == 0.25
    cosine = factors(lr_schedule="cosine", min_lr=0.01)
    assert cosine[0] == 1 and cosine[100] == pytest.approx(0.1) and cosine[50] == pytest.approx(0.55)
    onecycle = factors(lr_schedule="onecycle", min_lr=0.001)
    assert onecycle[0] == pytest.approx(1 / 25) and onecycle[30] == 1 and onecycle[100] == pytest.approx(0.01)
    assert max(onecycle) == 1 and onecycle.index(1) == 30  # 30% of the steps up, then down
    warm = factors(lr_schedule="constant", warmup_epochs=0.5)
    assert warm[0] == pytest.approx(1 / 5) and warm[4] == 1 and warm[50] == 1

    # imagenet.py's own schedules before they became the shared ones, bit for bit
    for name, warmup_epochs in (("step", 0.0), ("step", 1.5), ("cosine", 0.0), ("cosine", 1.0)):
        warmup = warmup_epochs * 10

        def before(step, name=name, warmup=warmup):
            if step < warmup:
                return (step + 1) / warmup
            if name == "cosine":
                return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, 100 - warmup)))
            return 0.1 ** (step // (3 * 10))

        now = factors(lr_schedule=name, warmup_epochs=warmup_epochs, lr_step_epochs=3)
        assert now == [before(step) for step in range(0, 101)], (name, warmup_epochs)

    plateau = LearningRateSchedule(TrainConfig(lr_schedule="plateau", plateau_patience=2), 100, 10)
    for loss in (1.0, 0.9, 0.95, 0.92, 0.91, 0.99):  # lower is better for a loss
        plateau.observe("eval_loss", loss)
    assert (
        plateau.plateau_best == 0.9
        and plateau.plateau_factor == pytest.approx(0.01)
        and plateau(50) == plateau.plateau_factor
    )


def test_a_time_budget_counts_the_epochs_whose_training_evaluations_and_test_fit():
    import argparse
    from dataclasses import replace

    from ddp_accel.budget import Costs, RunShape, plan_epochs
    from ddp_accel.cli import duration, format_duration

    assert [duration(text) for text in ("900", "900s", "15m", "15min", "1h30m", "2.5h", "1h0m5s")] == [
        900,
        900,
        900,
        900,
        5400,
        9000,
        3605,
    ]
    for bad in ("", "15 minutes", "m", "-5m", "0", "1d", "1h30", "1e3", "1" * 400, "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration(bad)
    assert [format_duration(s) for s in (0.042, 4.27, 45, 845, 3600, 3725)] == [
        "0.04 s",
        "4.3 s",
        "45 s",
        "14 min 5 s",
        "1 h 0 min",
        "1 h 2 min 5 s",
    ]

    # 1000 s; 100 s spent; reserve 3% + 5 s = 35 s; an epoch: 2 s to start + 40 batches x 2 s = 82 s; an
    # evaluation: 1 s + 10 x 0.5 s = 6 s (x2 with the EMA's); a test of 40 batches: 1 s + 40 x 0.5 s = 21 s
    costs = Costs(train_batch_s=2.0, train_start_s=2.0, eval_batch_s=0.5, eval_start_s=1.0, spent_s=100.0)
    shape = RunShape(batches_per_epoch=40, max_epochs=40, eval_batches=10, steps_per_epoch=40)
    plan = plan_epochs(1000, costs, shape)
    assert (plan.epochs, plan.epoch_s, plan.evaluation_s) == (9, 82.0, 6.0)  # 100 + 9 x 88 + 35 = 927; 10: 1015
    assert plan.estimated_s == pytest.approx(892 + 9 * 0.015) and plan.reserve_s == pytest.approx(35)  # + bookkeeping
    assert "9 epochs of 40 fit" in plan.describe()
    assert plan_epochs(1000, costs, replace(shape, evaluations_per_eval=2)).epochs == 9  # 100 + 9 x 94 + 35 = 981
    assert plan_epochs(1000, costs, replace(shape, evaluations_per_eval=2, test_batches=40)).epochs == 8  # 981 + 21
    assert plan_epochs(1000, costs, replace(shape, eval_batches=0)).epochs == 10  # 100 + 10 x 82 + 35 = 955
    assert plan_epochs(1000, costs, replace(shape, eval_every_epochs=4)).epochs == 10  # 3 evaluations: 100+820+18+35
    assert plan_epochs(1000, costs, replace(shape, eval_every_steps=20)).epochs == 8  # 3 an epoch: 100 + 8 x 100 + 35
    assert plan_epochs(10**6, costs, shape).epochs == 40  # never past --epochs
    assert plan_epochs(199, costs, shape).epochs == 1  # 100 + 88 + 11 (5 s + 3% of 199 s, rounded up)
    assert plan_epochs(198, costs, shape).epochs == 0  # not even one: the caller says so in one line


def test_a_time_budget_counts_from_the_process_start_a_launchers_start_or_now(monkeypatch):
    import time

    import psutil

    from ddp_accel.budget import COMMAND_START_VARIABLE, command_started, note_command_start

    monkeypatch.delenv(COMMAND_START_VARIABLE, raising=False)
    try:
        note_command_start(started_as_script=True)  # `python script.py`: the imports count
        assert command_started(0.0) == psutil.Process().create_time()
        note_command_start(started_as_script=False)  # a main() called in a test or a notebook: from now
        assert time.time() - command_started(0.0) < 5
        monkeypatch.setenv(COMMAND_START_VARIABLE, "1234.5")  # a Ray worker: the driver's start
        note_command_start(started_as_script=True)
        assert command_started(0.0) == 1234.5
    finally:
        note_command_start(None)
    assert command_started(7.0) == 7.0  # after the command: a later fit() counts from its own start


def test_the_budget_guard_ends_training_at_the_epoch_whose_successor_would_end_past_the_budget(monkeypatch):
    # a plan of 10 epochs of 8 s (+ 1 s evaluation) in 100 s, 8 s in reserve, a 2 s test; the clock is ours
    from ddp_accel.budget import BudgetGuard, BudgetPlan

    clock = [2.0]
    monkeypatch.setattr("ddp_accel.budget.time", SimpleNamespace(time=lambda: clock[0]))
    plan = BudgetPlan(100, 10, 10, 90, epoch_s=8, evaluation_s=1, reserve_s=8, test_s=2)
    run = SimpleNamespace(state=TrainState(), accelerator=SimpleNamespace(device="cpu", print=print))
    guard = BudgetGuard(plan, started=0.0)
    guard.on_start(run)
    for epoch, now in enumerate((11.0, 20.0, 40.0), start=1):  # on plan, on plan, then 20 s an epoch
        clock[0], run.state.epoch = now, epoch
        guard.on_epoch_end(run)
        assert not run.state.out_of_time, epoch  # 40 + 20 + 2 = 62: within 100 - 8 / 2
    clock[0], run.state.epoch = 75.0, 4  # 35 s an epoch now: 75 + 35 + 2 = 112 > 96
    guard.on_epoch_end(run)
    assert run.state.out_of_time and run.state.ended and run.state.end_reason().startswith("time budget")
    last = TrainState(epoch=10)  # the plan's last epoch: nothing to decide
    clock[0] = 500.0
    guard.on_epoch_end(SimpleNamespace(state=last, accelerator=run.accelerator))
    assert not last.out_of_time


# --- the allocator: what a step frees is kept for the next ---
ALLOCATE_AND_FREE = """
import ctypes, resource, sys
from ddp_accel import allocator
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def faults_of_steps(steps=4, size=64 << 20):  # a step's activations of 64 MiB, allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults_of_steps()
kept = allocator.keep_freed_memory(sys.argv[1])
faults_of_steps(1)  # the first step after: its pages come from the system once
print(default, kept, faults_of_steps(), allocator.describe() is not None)
"""


@pytest.mark.parametrize(
    "device, environment",
    [("cpu", {}), ("cpu", {"DDP_ACCEL_MALLOC": "system"}), ("cpu", {"MALLOC_TRIM_THRESHOLD_": "131072"}), ("cuda", {})],
)
def test_once_training_starts_the_memory_a_step_frees_is_reused_by_the_next_not_faulted_in_again(device, environment):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "DDP_ACCEL_MALLOC"))}
    result = subprocess.run(
        [sys.executable, "-c", ALLOCATE_AND_FREE, device], env={**env, **environment}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    default, kept, after, described = result.stdout.split()
    assert int(default) > 4 * 16000  # glibc's default: each block mmapped, its 16,384 pages faulted in each time
    # the user's choice (glibc's defaults, or its own tuning), or a GPU run (not measured there): left alone
    if environment or device != "cpu":
        assert (kept, described) == ("False", "False") and int(after) > 4 * 16000
    else:
        assert (kept, described) == ("True", "True") and int(after) < 100


def test_the_training_loop_keeps_freed_memory_and_says_so(tmp_path, capsys):
    fit_small(tmp_path / "run")
    assert "allocator" in capsys.readouterr().out and allocator.describe() is not None


def test_the_curves_draw_the_losses_left_and_the_scores_right(tmp_path):
    from PIL import Image

    from ddp_accel.plots import plot_history

    def drawn_in(path: Path, blue: bool) -> tuple[int, int]:
        """Pixels of the first line colour (matplotlib's C0 blue) or the second (C1 orange), left and right half."""
        image = np.asarray(Image.open(path).convert("RGB")).astype(int)
        colour = (31, 119, 180) if blue else (255, 127, 14)
        near = (np.abs(image - colour).sum(axis=2) < 30).astype(int)
        return int(near[:, : near.shape[1] // 2].sum()), int(near[:, near.shape[1] // 2 :].sum())

    history = [
        {"epoch": epoch, "train_loss": 1 / epoch, "eval_loss": 1.2 / epoch, "eval_accuracy": 0.5 + epoch / 20}
        for epoch in range(1, 6)
    ]
    plot_history(history, tmp_path / "curves.png", "a title")
    assert Image.open(tmp_path / "curves.png").size == (1100, 400)
    (train_left, train_right), (eval_left, _) = (
        drawn_in(tmp_path / "curves.png", True),
        drawn_in(tmp_path / "curves.png", False),
    )
    assert train_left > 500 and eval_left > 500 and train_right > 500  # C0: train_loss left, eval_accuracy right
    plot_history([{k: v for k, v in record.items() if k != "eval_accuracy"} for record in history], tmp_path / "l.png")
    assert drawn_in(tmp_path / "l.png", True)[1] == 0  # no score: the right panel stays empty


def test_a_survivor_saves_every_rank_s_place_only_where_one_replica_holds_it(tmp_path):
    # the decisions of ddp_accel.rescue, the launched kill in tests/test_faults.py: which streams are every
    # rank's, and what leaves the restart to the last checkpoint
    from types import SimpleNamespace

    from ddp_accel import rescue
    from ddp_accel.checkpoint_format import AcceleratorObjects, Contents
    from ddp_accel.comm_hooks import PowerSGDStates
    from ddp_accel.random_streams import RandomStreams
    from ddp_accel.state import RunIdentity, TrainState

    streams = RandomStreams.now()
    agreement = SimpleNamespace(
        agreed_streams=(7, streams, True), submitted_streams=(7, streams), buffers=[], submitted_buffers=None
    )
    assert rescue.streams_of(TrainState(step=7), agreement) is streams  # a failure inside step 8
    agreement.submitted_streams = (8, "this rank's after step 8")  # its agreement failed: the step before agreed
    assert rescue.streams_of(TrainState(step=8), agreement) == "this rank's after step 8"
    agreement.agreed_streams = (7, streams, False)  # the ranks' streams differed
    assert rescue.streams_of(TrainState(step=7), agreement) is None
    assert rescue.streams_of(TrainState(step=8), agreement) is None

    kind, cpu = "DistributedType.MULTI_CPU", torch.device("cpu")
    ddp = SimpleNamespace(distributed_type=kind, num_processes=2, process_index=0, device=cpu)
    assert rescue.why_not_rescued(ddp, Contents()) is None
    assert "shard" in rescue.why_not_rescued(SimpleNamespace(**{**vars(ddp), "distributed_type": "FSDP"}), Contents())
    assert "PowerSGD" in rescue.why_not_rescued(ddp, Contents(components=[PowerSGDStates(["a keeper"])]))
    assert rescue.why_not_rescued(ddp, Contents(components=[PowerSGDStates([])])) is None
    agreement.agreed_streams = (7, streams, True)
    mid_accumulation = TrainState(step=7, batches_in_epoch=15)
    line = rescue.save_what_survived(ddp, tmp_path, mid_accumulation, RunIdentity(), Contents(), agreement, 2)
    assert "inside a gradient accumulation" in line and not list(tmp_path.iterdir()), line
    # BatchNorm statistics are each rank's own (a checkpoint keeps rank 0's); SyncBatchNorm's are every rank's

    def holding(*layers):
        return Contents(objects=AcceleratorObjects(models=[torch.nn.Sequential(torch.nn.Linear(4, 4), *layers)]))

    # norm layers' statistics travel in the agreement (every rank holds process 0's); another floating-point
    # buffer a module may update with its batch is process 0's only
    class Tracker(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen_mean", torch.zeros(4))

    assert not rescue.ranks_own_buffers(holding()) and not rescue.ranks_own_buffers(holding(torch.nn.SyncBatchNorm(4)))
    assert not rescue.ranks_own_buffers(holding(torch.nn.BatchNorm1d(4), torch.nn.InstanceNorm1d(4, affine=True)))
    assert rescue.ranks_own_buffers(holding(torch.nn.BatchNorm1d(4), Tracker()))
    rank_1 = SimpleNamespace(**{**vars(ddp), "process_index": 1})
    line = rescue.save_what_survived(
        rank_1, tmp_path, TrainState(step=7), RunIdentity(), holding(Tracker()), agreement, 1
    )
    assert "process 0 was lost" in line and not list(tmp_path.iterdir()), line
    assert "process 0 saves the step" in rescue.describe(ddp, holding(Tracker()))
    assert "a survivor saves the step" in rescue.describe(ddp, holding(torch.nn.BatchNorm1d(4)))


def test_the_progress_bar_redraws_on_a_terminal_reached_by_either_stream(monkeypatch):
    # a one-process `accelerate launch` (1.16) pipes the script's stderr through itself onto the terminal
    from ddp_accel.callbacks import ProgressBar

    for stderr_tty, stdout_tty, redraws in ((True, False, True), (False, True, True), (False, False, False)):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=stderr_tty: tty)
        monkeypatch.setattr(sys.stdout, "isatty", lambda tty=stdout_tty: tty)
        assert ProgressBar().interactive is redraws, (stderr_tty, stdout_tty)


def test_the_progress_bar_in_a_log_file_writes_whole_lines(monkeypatch):
    # SLURM's and kubectl's logs are read by their newlines: a bar redrawn in place showed up only at its close
    from ddp_accel.callbacks import ProgressBar

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    bar = ProgressBar()
    run = SimpleNamespace(
        total_steps=10, state=SimpleNamespace(step=4), accelerator=SimpleNamespace(is_local_main_process=True)
    )
    bar.on_start(run)
    bar.bar.mininterval = bar.bar.miniters = 0  # a redraw at each step instead of every 30 s
    for _ in range(3):
        bar.on_step_end(run)
    bar.on_close(run)
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n"), repr(text)
    lines = text.splitlines()
    assert lines[0].startswith("train:") and "4/10" in lines[0] and "7/10" in lines[-1], lines


def test_every_option_belongs_to_a_section_and_a_section_holds_the_run_s_own_values():
    """Each component is built from its section of the options: an option in no section would be read by none,
    and a section must carry the values a command gave, not TrainConfig's defaults."""
    from dataclasses import fields

    from ddp_accel.config import SECTIONS

    options = {field.name for field in fields(TrainConfig)} - {"hparams"}
    in_sections = {field.name for section in SECTIONS.values() for field in fields(section)}
    assert options - in_sections == set(), "options in no section"
    assert in_sections - options == set(), "section fields that are no option"
    changed = {
        "checkpoint_limit": 3,
        "lr_schedule": "cosine",
        "hang_timeout_s": 7.0,
        "ema_decay": 0.9,
        "eval_steps": 5,
        "profile_steps": (1, 2),
        "batch_size": 4,
        "max_grad_norm": 1.5,
        "epochs": 4,
        "compile_backend": "eager",
        "ddp_comm_hook": "fp16",
        "output_dir": "elsewhere",
    }
    config = TrainConfig(**changed)
    for name, section_type in SECTIONS.items():
        section = getattr(config, name)
        assert type(section) is section_type
        for field in fields(section):
            assert getattr(section, field.name) == getattr(config, field.name), (name, field.name)
    assert config.checkpointing.checkpoint_limit == 3 and config.watchdog.hang_timeout_s == 7.0


def test_the_loop_is_forward_backward_clip_step_in_that_order(tmp_path):
    """The trained weights are those of the hand-written loop that clips each step's gradient (and not those of
    one that does not clip)."""
    task = small_task()
    task.train_loader = DataLoader(task.train_loader.dataset, batch_size=8, shuffle=False)
    start = {key: value.clone() for key, value in task.model.state_dict().items()}
    config = TrainConfig(output_dir=str(tmp_path / "run"), epochs=1, max_grad_norm=0.05)
    try:
        fit(make_accelerator(config), config, task)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)

    def by_hand(clip: bool) -> dict[str, torch.Tensor]:
        model = torch.nn.Linear(4, 2)
        model.load_state_dict(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in DataLoader(task.train_loader.dataset, batch_size=8, shuffle=False):
            task.loss_fn(model, batch).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
        return model.state_dict()

    trained = task.model.state_dict()
    assert all(torch.allclose(trained[key], value, atol=1e-6) for key, value in by_hand(clip=True).items())
    assert not all(torch.allclose(trained[key], value, atol=1e-6) for key, value in by_hand(clip=False).items())
