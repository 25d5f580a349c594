"""The progress watchdog: silent while a run progresses, however slowly; when no step comes within the bound, it
writes every thread's stack and the DataLoader workers' state, says in one line where the rank waits, and exits
with its own status."""

import threading
import time

import pytest
import torch
from helpers import check_ok, launch, run_script, weights
from torch.utils.data import DataLoader, Dataset

from ddp_accel import loaders
from ddp_accel.streaming import WindowShuffle
from ddp_accel.watchdog import HANG_EXIT_CODE, Bounds, ProgressWatchdog


class Exits:
    """Records the exit status instead of ending pytest."""

    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


@pytest.mark.inprocess
def test_a_progressing_run_never_fires_and_a_stalled_one_fires_within_the_bound(tmp_path, capsys):
    exits = Exits()
    watchdog = ProgressWatchdog(tmp_path, rank=3, bounds=Bounds(floor_s=0.2, factor=4, first_s=0.75), exit=exits)
    watchdog.start()
    try:
        time.sleep(0.5)  # a slow first step (compilation, worker start-up): under first_s
        for step in range(8):  # steps of 0.025-0.05 s, a checkpoint save of 0.4 s between two of them
            time.sleep(0.025 + 0.025 * (step % 2))
            watchdog.beat(f"step {step + 1}")
            if step == 4:
                with watchdog.activity("checkpoint save"):
                    time.sleep(0.4)
        assert not watchdog.fired.is_set() and not exits.codes
        stalled = time.monotonic()
        assert watchdog.fired.wait(5)
        waited = time.monotonic() - stalled
    finally:
        watchdog.stop()
    assert 0.2 <= waited < 0.75, waited  # the bound: max(floor 0.2 s, 4 x the slowest step 0.05 s)
    assert exits.codes == [HANG_EXIT_CODE]
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: rank 3 made no progress for") and "in phase train, after step 8" in line, line
    assert "it is in wait (threading.py" in line, line  # where the main thread waits: fired.wait above
    report = (tmp_path / "hangs" / "rank_3.txt").read_text()
    assert "Python stacks of every thread" in report and "ddp_accel-watchdog" not in report.split("\n")[0]
    assert 'File "' in report and "test_watchdog.py" in report


@pytest.mark.inprocess
def test_work_of_a_kind_seen_before_is_bounded_by_its_own_pace_not_the_first_bound(tmp_path):
    # a peer stopped while this rank waits in the barrier of its second checkpoint: found within the step bound,
    # not after first_s (which only the first save of a run gets, as compilation and start-up do)
    exits = Exits()
    watchdog = ProgressWatchdog(tmp_path, rank=0, bounds=Bounds(floor_s=0.4, factor=4, first_s=30), exit=exits).start()
    try:
        for step in range(4):
            time.sleep(0.02)
            watchdog.beat(f"step {step + 1}")
        with watchdog.activity("the checkpoint of step 4", kind="checkpoint"):
            time.sleep(0.15)  # the first save: under first_s, whatever it takes
        watchdog.beat("step 5")
        assert not watchdog.fired.is_set()
        stalled = time.monotonic()
        with watchdog.activity("the checkpoint of step 5", kind="checkpoint"):
            assert watchdog.fired.wait(10)  # the bound: max(0.4 s, 4 x 0.02 s, 4 x 0.15 s) = 0.6 s
        waited = time.monotonic() - stalled
    finally:
        watchdog.stop()
    assert 0.6 <= waited < 2, waited  # polled at a tenth of the floor, not of first_s (3 s)
    assert exits.codes == [HANG_EXIT_CODE]


class BlocksAt(Dataset):
    """Sample `index` blocks forever: a DataLoader worker hung in the dataset (a dead NFS mount, a deadlock)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.index:
            threading.Event().wait()
        return torch.tensor(index)


@pytest.mark.multiprocess  # a forkserver and a worker process
def test_a_hung_dataloader_worker_is_named_and_killed(tmp_path, capsys):
    exits = Exits()
    # before its second beat the watchdog waits first_s (the forkserver's start), then 1 s
    watchdog = ProgressWatchdog(
        tmp_path, rank=0, bounds=Bounds(floor_s=1.0, factor=2, first_s=60), phase=lambda: "eval", exit=exits
    )
    watchdog.start()
    loader = DataLoader(BlocksAt(9), batch_size=2, num_workers=1)
    seen = []
    try:
        # the watchdog killed the worker: torch notices it (or the batch it was sending breaks off)
        with pytest.raises((RuntimeError, ConnectionError)):
            with loaders.batches(loader) as batches:
                for batch in batches:
                    seen += batch.tolist()
                    watchdog.beat(f"eval batch {len(seen) // 2}")
    finally:
        watchdog.stop()
    assert seen == list(range(8)) and exits.codes == [HANG_EXIT_CODE]
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "rank 0 made no progress" in line and "in phase eval, after eval batch 4" in line, line
    assert "it waits for its DataLoader workers (pids" in line, line
    report = (tmp_path / "hangs" / "rank_0.txt").read_text()
    assert "alive, started" in report, report[:2000]


@pytest.mark.inprocess
def test_a_fixed_bound_and_off(tmp_path):
    fixed = ProgressWatchdog(tmp_path, 0, timeout_s=7, bounds=Bounds(first_s=100))
    assert fixed.bound_s() == 100  # before the first steps: compilation, worker start-up
    fixed.beat("step 1")
    fixed.beat("step 2")
    assert fixed.bound_s() == 7
    watchdog = ProgressWatchdog(tmp_path, 0, timeout_s=0)
    assert not watchdog.enabled and watchdog.start()._thread is None


@pytest.mark.multiprocess
@pytest.mark.parametrize("data", ["in-memory", "shards"])
def test_one_process_with_a_hung_worker_exits_4_and_the_rerun_resumes_to_identical_weights(tmp_path, data):
    # shards: a worker's read of a shard that never returns (a dead network file system), at the sample that comes
    # 71st in the first epoch's order (after the first steps: a start-up is bounded apart)
    args, sample = [], 70
    if data == "shards":
        from probe import write_id_shards

        write_id_shards(tmp_path / "shards", 96, per_shard=30)
        order = WindowShuffle([30, 30, 30, 6], seed=0, window=24)  # the probe's order of its shards
        args, sample = ["--shards", tmp_path / "shards"], list(order)[70]
    args += [
        "--batch-size",
        "4",
        "--train-size",
        "96",
        "--epochs",
        "2",
        "--dropout",
        "0.3",
        "--checkpointing-steps",
        "4",
    ]
    args += ["--workers", "1"]
    check_ok(run_script("tests/probe.py", *args, "--output-dir", tmp_path / "reference"))  # in this process
    hung = [*args, "--hang-at-sample", sample, "--hang-timeout-s", "3", "--resume-from-checkpoint", "latest"]
    started = time.monotonic()
    first = launch("tests/probe.py", *hung, "--output-dir", tmp_path / "hung", launcher="python")
    took = time.monotonic() - started
    output = first.stdout + first.stderr
    assert first.returncode == HANG_EXIT_CODE, output[-3000:]
    assert "error: rank 0 made no progress" in output and "it waits for its DataLoader workers" in output, output
    assert (tmp_path / "hung" / "hangs" / "rank_0.txt").is_file()
    assert took < 60, took
    rerun = check_ok(launch("tests/probe.py", *hung, "--output-dir", tmp_path / "hung", launcher="python"))
    assert "made no progress" not in rerun
    reference, resumed = weights(tmp_path / "reference"), weights(tmp_path / "hung")
    assert reference.keys() == resumed.keys() and all(torch.equal(reference[k], resumed[k]) for k in reference)
