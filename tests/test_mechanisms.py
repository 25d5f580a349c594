"""One test per mechanism that a single-point bug could break unseen (tests/mutations/check.py, issue 43 item 12):
the decisions the ranks must agree on (with a peer faked in this process), the mixing draws of each micro-batch,
the watchdog's heartbeat during an evaluation, the doctor command's own checks, the forkserver that dies with its
training process, the options -e and --predict must share with training, the stop that does not save a step
twice, callback states of one key, and the start-up guard under nohup."""

import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from helpers import ROOT, assert_clean_error, check_ok, run_script, wait_for
from torch.utils.data import DataLoader, TensorDataset

from ddp_accel import Callback, UserError
from ddp_accel.checkpoint import Checkpoints
from ddp_accel.state import RunIdentity, TrainState

PROBE = "tests/probe.py"


@pytest.fixture
def accelerator():
    accelerator = Accelerator(cpu=True)
    yield accelerator
    AcceleratorState._reset_state(reset_partial_state=True)


def a_peer(peer_values):
    """A fake `torch.distributed` for a module under test: its all_reduce combines this rank's tensor with the next
    of `peer_values` (the other rank's tensor at that call) by the reduce op asked for."""
    combine = {dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.SUM: torch.add}
    peers = iter(peer_values)

    def all_reduce(tensor, op=dist.ReduceOp.SUM):
        peer = torch.as_tensor(next(peers), dtype=tensor.dtype)
        tensor.copy_(combine[op](tensor, peer))

    return SimpleNamespace(all_reduce=all_reduce, ReduceOp=dist.ReduceOp)


# --- decisions every rank must take alike: each rank's view, then one all-reduce ---
@pytest.mark.inprocess
def test_auto_batch_size_takes_the_largest_micro_batch_that_fits_on_every_rank(monkeypatch):
    # this rank fits all 12 samples; the peer runs out of memory above 4: both must train micro-batches of 4 (the
    # largest rank's choice makes the peer fail at its first step, or run another accumulation than this rank)
    from ddp_accel import batch_size

    tried: list[int] = []

    def loss_fn(model, batch):
        tried.append(len(batch[0]))
        return model(batch[0]).sum()

    monkeypatch.setattr(batch_size, "distributed", lambda: True)
    monkeypatch.setattr(batch_size, "dist", a_peer(float(size <= 4) for size in (12, 6, 4, 3, 2, 1)))
    accelerator = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    loader = DataLoader(TensorDataset(torch.randn(12, 3)), batch_size=12)
    assert batch_size.find_micro_batch(accelerator, torch.nn.Linear(3, 1), loss_fn, loader, 12) == 4
    assert tried == [12, 6, 4]


@pytest.mark.inprocess
def test_auto_batch_size_collects_garbage_after_a_size_that_ran_out_of_memory_not_after_the_one_that_fit(monkeypatch):
    # an out-of-memory error's frames hold the pass's activations in cycles: collected before the next, smaller try;
    # the pass that fit freed its own as it returned (a full collection of a large process is slow)
    from ddp_accel import batch_size

    events: list[object] = []

    def loss_fn(model, batch):
        events.append(len(batch[0]))
        if len(batch[0]) > 3:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return model(batch[0]).sum()

    monkeypatch.setattr(batch_size, "clear_device_cache", lambda garbage_collection: events.append(garbage_collection))
    accelerator = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    loader = DataLoader(TensorDataset(torch.randn(12, 3)), batch_size=12)
    assert batch_size.find_micro_batch(accelerator, torch.nn.Linear(3, 1), loss_fn, loader, 12) == 3
    assert events == [12, True, 6, True, 4, True, 3, False]


@pytest.mark.inprocess
def test_a_time_budget_plans_every_rank_on_the_slowest_ranks_costs(monkeypatch):
    # each figure is the slowest rank's (an epoch ends when the slowest rank ends it): a plan from this rank's
    # faster batches would give the peer more epochs than fit in its budget
    from ddp_accel import budget

    mine = {"train": budget.Costs(0.01, 0.2), "eval": budget.Costs(0.005, 0.3)}
    monkeypatch.setattr(budget, "time_batches", lambda loader, *args: budget.Costs(**vars(mine[loader])))
    monkeypatch.setattr(budget, "distributed", lambda: True)
    peer = [0.05, 0.1, 0.001, 0.5, 30.0]  # train batch, train start, eval batch, eval start, spent
    monkeypatch.setattr(budget, "dist", a_peer([peer]))
    model = torch.nn.Linear(3, 1)
    timing = budget.Timing(
        accelerator=SimpleNamespace(device=torch.device("cpu"), scaler=None, step=0),
        train_batch=lambda batch: None,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_loader="train",
        eval_fn=lambda model, batch: None,
        eval_loader="eval",
        accumulation=1,
        started=time.time(),
    )
    costs = budget.measure_costs(timing)
    expected = [0.05, 0.2, 0.005, 0.5, 30.0]
    assert [costs.train_batch_s, costs.train_start_s, costs.eval_batch_s, costs.eval_start_s, costs.spent_s] == (
        pytest.approx(expected)
    )


@pytest.mark.inprocess
def test_the_budget_guard_ends_training_on_every_rank_when_one_rank_is_late(monkeypatch):
    # this rank keeps to the plan, its peer (a loaded node) would end past the budget: both stop at this epoch,
    # or the rank that goes on waits in its next all-reduce for a peer that has left
    from ddp_accel import budget

    clock = [11.0]
    monkeypatch.setattr(budget, "time", SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.setattr(budget, "distributed", lambda: True)
    monkeypatch.setattr(budget, "dist", a_peer([0.0, 1.0]))  # the peer: on time at epoch 1, late at epoch 2
    plan = budget.BudgetPlan(100, 10, 10, 90, epoch_s=8, evaluation_s=1, reserve_s=8, test_s=2)
    run = SimpleNamespace(state=TrainState(epoch=1), accelerator=SimpleNamespace(device="cpu", print=print))
    guard = budget.BudgetGuard(plan, started=0.0)
    guard.epoch_began = 2.0
    guard.on_epoch_end(run)  # 11 + 9 + 2 = 22: on time here, and on the peer
    assert not run.state.out_of_time
    clock[0], run.state.epoch = 20.0, 2
    guard.on_epoch_end(run)  # still on time here (20 + 9 + 2 = 31), late on the peer
    assert run.state.out_of_time and run.state.end_reason().startswith("time budget")


# --- randomness that must differ per micro-batch ---
@pytest.mark.inprocess
def test_each_micro_batch_of_an_accumulated_step_is_mixed_with_draws_of_its_own():
    # with gradient accumulation an optimizer step takes several micro-batches: each is mixed from its own position
    # (step, micro-batch), counted by the mixing itself, and the count starts again at the next step
    from ddp_accel.vision import BatchMixing

    images, targets = torch.rand(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 4, 0])

    def mixed_at(step: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        reference = BatchMixing(num_classes=5, seed=3, mixup_alpha=0.4, cutmix_alpha=1.0)
        reference.step, reference.micro_batch = step, micro_batch
        return reference(images, targets)

    mixing = BatchMixing(num_classes=5, seed=3, mixup_alpha=0.4, cutmix_alpha=1.0)
    run = SimpleNamespace(state=SimpleNamespace(step=7))
    mixing.on_start(run)
    for step, micro_batch in ((7, 0), (7, 1), (7, 2), (8, 0), (8, 1)):
        run.state.step = step
        got, expected = mixing(images, targets), mixed_at(step, micro_batch)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (step, micro_batch)
    first, second = mixed_at(7, 0), mixed_at(7, 1)
    assert not torch.equal(first[1], second[1]), "two positions of one step draw alike: the test proves nothing"


# --- the watchdog hears evaluation batches ---
@pytest.mark.inprocess
def test_every_evaluation_batch_is_a_heartbeat_of_the_watchdog(tmp_path, monkeypatch):
    # an evaluation lasts longer than the bound taken from the training steps' pace: without a beat per evaluation
    # batch the watchdog would take a long evaluation for a hang and end the rank with exit 4
    from ddp_accel import run_setup
    from ddp_accel.watchdog import ProgressWatchdog

    beats: list[str] = []
    fired: list[int] = []

    class Recording(ProgressWatchdog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "exit": fired.append})

        def beat(self, what: str) -> None:
            beats.append(what)
            super().beat(what)

    monkeypatch.setattr(run_setup, "ProgressWatchdog", Recording)
    # 16 training samples in batches of 4: 4 steps; 23 validation samples: 6 evaluation batches, at the epoch's end
    args = ["--output-dir", tmp_path / "run", "--batch-size", 4, "--train-size", 16, "--epochs", 1, "--dropout", 0]
    check_ok(run_script(PROBE, *args))
    assert beats[:4] == [f"batch {n} of epoch 1" for n in range(1, 5)], beats
    assert beats[4:] == ["an evaluation batch at step 4"] * 6, beats
    assert not fired


# --- the doctor command says what its checks find ---
@pytest.mark.inprocess
def test_the_doctor_command_reports_data_missing_here_and_a_disk_nearly_full(tmp_path, monkeypatch, capsys):
    # compare() is tested on its own (test_doctor.py); this is the command: its report must carry what --data and
    # --output-dir found, whatever the launcher (one process here)
    from ddp_accel.__main__ import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "data").mkdir()
    # the disk is this machine's own (CI's had 4.5 GB free): what the command does with it is asked by --min-free-gb
    free_gb = shutil.disk_usage(tmp_path).free / 2**30
    below_this_disk = ["--min-free-gb", f"{free_gb / 2:.3f}"]
    assert (
        main(["doctor", "--output-dir", str(tmp_path / "out"), "--data", str(tmp_path / "data"), *below_this_disk]) == 0
    )
    assert "doctor: all is well: 1 process(es)" in capsys.readouterr().out
    assert (
        main(["doctor", "--output-dir", str(tmp_path / "out"), "--data", str(tmp_path / "nowhere"), *below_this_disk])
        == 1
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("doctor: ")]
    assert len(lines) == 1 and f"--data {tmp_path / 'nowhere'} does not exist there" in lines[0], lines
    monkeypatch.setattr("ddp_accel.doctor.shutil.disk_usage", lambda path: SimpleNamespace(free=2**30))
    assert main(["doctor", "--output-dir", str(tmp_path / "out")]) == 1  # 1 GB under the default 5
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("doctor: ")]
    assert len(lines) == 1 and f"1.0 GB free under --output-dir {tmp_path / 'out'}" in lines[0], lines
    assert main(["doctor", "--output-dir", str(tmp_path / "out"), "--min-free-gb", "0.5"]) == 0


# --- helper processes die with the training process ---
TRAINING_PROCESS = """
import multiprocessing
import time

import psutil
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_accel import loaders, startup

if __name__ == "__main__":
    startup.start_forkserver(startup.WORKER_SERVER_MODULES)  # as run_main does for a command that asks for workers
    loader = DataLoader(TensorDataset(torch.arange(64)), batch_size=1, num_workers=2)
    with loaders.batches(loader) as batches:
        for _ in range(4):  # a batch from each worker: both run their loop, which watches their parent
            next(batches)
        workers = [child.pid for child in multiprocessing.active_children() if child.daemon]
        server = next(c.pid for c in psutil.Process().children() if startup.FORKSERVER_COMMAND in " ".join(c.cmdline()))
        print(server, *workers, flush=True)
        time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.multiprocess  # a training process of its own, killed
def test_the_forkserver_and_the_dataloader_workers_die_with_a_training_process_killed_by_sigkill(tmp_path):
    # SIGKILL (out of memory, a test's cleanup) gives the training process no chance to stop its helpers: the
    # forkserver must die with it (its parent-death signal), and then the workers, which watch their parent
    script = tmp_path / "train.py"
    script.write_text(TRAINING_PROCESS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    training = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    helpers: list[int] = []
    try:
        line = training.stdout.readline()
        assert line, training.stderr.read()[-3000:]
        helpers = [int(pid) for pid in line.split()]
        assert len(helpers) == 3 and all(alive(pid) for pid in helpers), line
        training.kill()
        training.wait(30)
        wait_for(lambda: not any(alive(pid) for pid in helpers), timeout=30, what="the forkserver and workers to end")
    finally:
        if training.poll() is None:
            training.kill()
            training.wait(30)
        for pid in helpers:  # (only these: the test's own helpers, left by a failure)
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# --- the options a prediction depends on, at every entry point ---
@pytest.mark.inprocess
def test_evaluate_refuses_weights_trained_under_another_augmentation_or_normalisation(tmp_path):
    # -e reads the validation images as --augment, --mean and --std say: weights trained under other values
    # would be scored on images they never saw, a wrong figure without a word
    common = ["--dummy", "--dummy-classes", 3, "-a", "cifar_resnet20", "--image-size", 16, "-b", 2, "-j", 0]
    out = tmp_path / "run"
    trained = [*common, "--augment", "cifar", "--max-steps", 1, "--epochs", 1, "--output-dir", out]
    check_ok(run_script("scripts/imagenet.py", *trained))
    evaluate = [*common, "-e", "--resume", out / "model.safetensors", "--output-dir", out]
    check_ok(run_script("scripts/imagenet.py", *evaluate, "--augment", "cifar"))
    refused = run_script("scripts/imagenet.py", *evaluate, "--augment", "imagenet")
    assert_clean_error(refused, "--augment was 'cifar', now 'imagenet'")
    refused = run_script("scripts/imagenet.py", *evaluate, "--augment", "cifar", "--mean", 0, 0, 0)
    assert_clean_error(refused, "--mean was [0.485, 0.456, 0.406], now [0.0, 0.0, 0.0]")


@pytest.mark.inprocess
def test_predict_refuses_data_options_other_than_the_models(tmp_path):
    # --max-length truncates each text before the model reads it: --predict under another value than training's
    # classifies other inputs than the model was trained on (the model's own options are checked the same way)
    out = tmp_path / "trained"
    out.mkdir()
    (out / "args.json").write_text(json.dumps({"max_length": None, "min_freq": 2, "ngrams": 3}))
    for name in ("vocab.json", "model.safetensors"):  # present; the check refuses before they are read
        (out / name).write_text("{}")
    refused = run_script("scripts/imdb.py", "--output-dir", out, "--predict", "a film", "--max-length", 7)
    assert_clean_error(refused, "--predict uses the options the model", "--max-length 7 (the model was trained with")
    refused = run_script("scripts/imdb.py", "--output-dir", out, "--predict", "a film", "--min-freq", 5)
    assert_clean_error(refused, "--min-freq 5 (the model was trained with 2)")


# --- a stop right after a save keeps that checkpoint ---
@pytest.mark.inprocess
def test_a_stop_right_after_a_save_does_not_write_the_same_checkpoint_again(tmp_path, accelerator):
    # the stop's save would spend the launcher's grace writing what is on disk, and remove the complete checkpoint
    # before its copy is renamed into place: a SIGKILL at that moment leaves no checkpoint of the step
    accelerator.prepare(torch.nn.Linear(2, 2))
    identity = RunIdentity("Linear:abc", {"options": {"hidden": 4}, "versions": {}})
    checkpoints = Checkpoints(accelerator, tmp_path / "checkpoints", every=4)
    saves: list[str] = []
    checkpoints.on_saved.append(lambda path, seconds: saves.append(path.name))
    state = TrainState(step=4, batches_in_epoch=4, global_batch=4)
    assert checkpoints.maybe_save(state, identity).name == "step_4" and saves == ["step_4"]
    written = (tmp_path / "checkpoints" / "step_4" / "training_state.json").stat().st_mtime_ns
    assert checkpoints.save_reached(state, identity) == tmp_path / "checkpoints" / "step_4"
    assert saves == ["step_4"]
    assert (tmp_path / "checkpoints" / "step_4" / "training_state.json").stat().st_mtime_ns == written
    state.step, state.batches_in_epoch = 5, 5  # a step later: the stop saves it
    assert checkpoints.save_reached(state, identity).name == "step_5" and saves == ["step_4", "step_5"]


# --- callback states: two of one key keep their own ---
class Counter(Callback):
    state_key = "counter"

    def __init__(self, count: int = 0):
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


@pytest.mark.inprocess
def test_two_callbacks_of_one_state_key_each_resume_their_own_state(tmp_path, accelerator):
    from ddp_accel.callback_state import CallbackStates

    states = CallbackStates([Counter(1), Counter(2)])
    assert list(states.by_key) == ["counter", "counter#2"]
    states.save(tmp_path, 0, 1)
    first, second = Counter(), Counter()
    assert CallbackStates([first, second]).load(tmp_path) == []
    assert (first.count, second.count) == (1, 2)


# --- the start-up guard ---
@pytest.mark.inprocess
def test_the_start_up_guard_leaves_sighup_ignored_under_nohup(monkeypatch, tmp_path):
    # `nohup python script.py &`: the terminal's hang-up must not end the run, during its imports neither (the
    # handlers are set, never run, here: each would end pytest; conftest puts the previous ones back)
    from ddp_accel.startup import stop_during_imports

    monkeypatch.setattr(sys, "argv", ["script.py", "--output-dir", str(tmp_path)])
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stop_during_imports(default_output_dir="unused")
    assert not gc.isenabled()  # paused for the imports (conftest turns it on again; run_main does in a script)
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    assert all(callable(signal.getsignal(signum)) for signum in (signal.SIGTERM, signal.SIGUSR1))
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # not under nohup: a hang-up stops the run with its marker
    stop_during_imports(default_output_dir="unused")
    assert callable(signal.getsignal(signal.SIGHUP))


# --- the launcher check ---
@pytest.mark.inprocess
def test_an_env_launch_of_one_process_needs_no_rendezvous_address():
    # WORLD_SIZE=1 exported by a job script (one srun task, a cluster's defaults): a lone process, no rendezvous;
    # only a group of several needs rank 0's address and port
    from ddp_accel.runtime import check_launch_environment

    check_launch_environment({"RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(UserError, match="WORLD_SIZE=2 without MASTER_ADDR and MASTER_PORT"):
        check_launch_environment({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.multiprocess
def test_a_dataloader_worker_whose_forkserver_is_already_gone_ends_at_its_first_act():
    # torch's worker watches its parent only once its loop runs: one still starting when the forkserver died lived
    # on for good; its first act (loaders._ignore_preemption) now ends it when its parent is not the forkserver
    import subprocess
    import sys

    code = (
        "import os; os.environ['DDP_ACCEL_WORKER_SERVER'] = str(os.getppid() + 100000)\n"
        "from ddp_accel.loaders import _ignore_preemption\n"
        "_ignore_preemption(None, 0)\n"
        "print('the worker went on')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "went on" not in result.stdout, result


# --- the run's folder: built and checked once ---
@pytest.mark.inprocess
def test_the_output_folder_is_built_and_checked_once_per_run(tmp_path, monkeypatch):
    # Run checks --output-dir before anything is built; its fit goes on with that folder and checks again only
    # what needs the checkpoints (`latest`)
    from ddp_accel import run_folder

    built: list[str] = []
    checks: list[bool | None] = []

    class Counted(run_folder.RunFolder):
        def __init__(self, path):
            built.append(str(path))
            super().__init__(path)

        def check(self, resume_from_checkpoint, overwrite, has_checkpoints=None):
            checks.append(has_checkpoints)
            super().check(resume_from_checkpoint, overwrite, has_checkpoints)

    from ddp_accel import runtime

    monkeypatch.setattr(runtime, "RunFolder", Counted)
    from ddp_accel import training

    monkeypatch.setattr(training, "RunFolder", Counted)  # what fit makes, when it makes one
    args = ["--output-dir", tmp_path / "run", "--batch-size", 4, "--train-size", 16, "--checkpointing-steps", 2]
    check_ok(run_script(PROBE, *args, "--epochs", 1))
    assert built == [str(tmp_path / "run")] and checks == [None], (built, checks)
    built.clear()
    checks.clear()
    check_ok(run_script(PROBE, *args, "--epochs", 2, "--resume-from-checkpoint", "latest"))
    assert built == [str(tmp_path / "run")] and checks == [None, True], (built, checks)  # `latest`: fit decides
    built.clear()
    checks.clear()
    # a trained model there and no --overwrite-output-dir: refused before training
    refused = run_script(PROBE, *args, "--epochs", 1)
    assert refused.returncode == 2 and "already holds a trained model" in refused.stderr, refused.stderr
    assert built == [str(tmp_path / "run")] and checks == [None]


@pytest.mark.inprocess
def test_before_the_first_step_of_a_resume_the_checkpoints_are_listed_once_and_each_state_read_once(
    tmp_path, monkeypatch
):
    # the folder's checks, `latest`, the time-budget plan, the integrity check and the load share one listing
    # (RunFolder.listing): it was listed 4 times and each training_state.json read 4-5 times
    from collections import Counter

    from ddp_accel import checkpoint, checkpoint_format, training

    args = ["--output-dir", tmp_path / "run", "--batch-size", 4, "--train-size", 16, "--checkpointing-steps", 2]
    check_ok(run_script(PROBE, *args, "--epochs", 1, "--time-budget", "1h"))
    listed, read, before_step_1 = Counter(), Counter(), {}
    complete, reader, start = (
        checkpoint.complete_checkpoints,
        checkpoint.read_training_state,
        training.Trainer.start,
    )

    def counted_complete(root, read=None):
        listed[str(root)] += 1
        return complete(root, read)

    def counted_read(path):
        read[path.name] += 1
        return reader(path)

    def counted_start(run):
        result = start(run)
        before_step_1.update(listed=dict(listed), read=dict(read))
        return result

    monkeypatch.setattr(checkpoint, "complete_checkpoints", counted_complete)
    monkeypatch.setattr(checkpoint, "read_training_state", counted_read)
    monkeypatch.setattr(checkpoint_format, "read_training_state", counted_read)
    monkeypatch.setattr(training.Trainer, "start", counted_start)
    check_ok(run_script(PROBE, *args, "--epochs", 2, "--time-budget", "1h", "--resume-from-checkpoint", "latest"))
    assert before_step_1["listed"] == {str(tmp_path / "run" / "checkpoints"): 1}, before_step_1
    assert before_step_1["read"] == {"step_2": 1, "step_4": 1}, before_step_1


@pytest.mark.inprocess
def test_an_absent_lomo_is_answered_without_a_search_at_each_step_and_an_installed_one_is_left_alone(
    monkeypatch, tmp_path
):
    # Accelerate asks importlib for lomo_optim twice at every optimizer.step(): a search of every sys.path entry
    import importlib.machinery

    from accelerate.utils import is_lomo_available

    from ddp_accel import runtime

    monkeypatch.delitem(sys.modules, "lomo_optim", raising=False)
    check_ok(run_script("tests/probe.py", "--output-dir", tmp_path / "run", "--max-steps", "2"))
    assert "lomo_optim" in sys.modules and sys.modules["lomo_optim"] is None  # marked by the Accelerator's making
    searches = []
    real = importlib.machinery.PathFinder.find_spec
    monkeypatch.setattr(
        importlib.machinery.PathFinder, "find_spec", lambda *a, **k: searches.append(a) or real(*a, **k)
    )
    assert not is_lomo_available() and not searches
    installed = tmp_path / "site" / "lomo_optim"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(installed.parent))
    monkeypatch.delitem(sys.modules, "lomo_optim")
    runtime.mark_lomo_absent()
    assert "lomo_optim" not in sys.modules  # there: not marked
