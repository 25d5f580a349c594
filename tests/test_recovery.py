"""`ddp-accel launch --recover in-process`: a SIGKILL of one rank, and the survivors go on in their own processes,
ending bitwise as the run without the failure (ddp_accel/recovery.py)."""

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BIN,
    ROOT,
    STANDARD_PROBE_ARGS,
    assert_same_weights,
    check_ok,
    kill_tree,
    launch,
    parents,
    process_tree,
    run_script,
    wait_for,
)

from ddp_accel.recovery import GENERATION, SLOT, Facts, resumed_arguments
from ddp_accel.recovery import LOST_AT as LOST_AT_VARIABLE

PROBE = str(ROOT / "tests" / "probe.py")


@pytest.mark.inprocess
def test_survivors_keep_the_global_batch_only_in_pieces_that_divide_it():
    exact = Facts(step=7, global_batch=12, exact_micro_batch=2)
    assert exact.shares(2) == 6 and exact.shares(3) == 4
    assert exact.shares(5) is None  # 12 samples do not divide over 5 processes
    assert Facts(7, 12, 4).shares(2) is None  # 6 a process is not pieces of 4
    assert Facts(7, 12, 0).shares(2) is None  # without --exact-micro-batch the sum's order moves: a replacement
    assert resumed_arguments(["-b", "4"], 6) == ["-b", "4", "--resume-from-checkpoint", "latest", "--batch-size", "6"]
    assert resumed_arguments(["-b", "4"], None) == ["-b", "4", "--resume-from-checkpoint", "latest"]


@pytest.mark.inprocess
@pytest.mark.parametrize(("min_processes", "replaced"), [(None, True), (3, True), (2, False)])
def test_survivors_finish_without_a_replacement_only_as_many_as_min_processes(min_processes, replaced, capsys):
    from ddp_accel.recovery import KEY, Launcher

    launcher = Launcher(["python", "train.py"], 3, min_processes=min_processes)
    started = []
    launcher.start = lambda slot, **how: started.append((slot, how)) or object()  # no process: the decision alone
    facts = {"step": 5, "global_batch": 12, "exact_micro_batch": 2}
    assert launcher.regroup({"0": facts, "2": facts}, lost_at=1.0)
    plan = json.loads(launcher.store.get(f"{KEY}/generation_1"))
    assert plan["members"] == ["0", "2"] and plan["batch_size"] == 6  # the survivors alone, either way
    assert started == ([("1", {"resume": True, "joins": True})] if replaced else [])
    assert ("no replacement" in capsys.readouterr().err) is not replaced
    # a second loss leaves 1 survivor: below 2, every lost one is replaced (each joins once ready)
    assert launcher.regroup({"0": {**facts, "step": 9}}, lost_at=2.0)
    assert sorted(slot for slot, _ in started) == ["1", "2"] and set(launcher.joining) == {"1", "2"}


@pytest.mark.inprocess
def test_a_group_whose_every_member_holds_the_step_resumes_it_at_once_another_once_its_files_are_written(
    tmp_path, monkeypatch
):
    # the survivors keep their copy of the step while one of them writes its files in the background: the
    # launcher names the step where every member holds it (the survivors alone), and they resume it before its
    # files exist; where a member reads them (a replacement, a process that saved nothing), every member waits
    # for the rescue in flight (not for one whose writer is dead)
    from ddp_accel.checkpoint import RESCUE_WRITER, Checkpoints, complete
    from ddp_accel.checkpoint_format import HELD, HeldCheckpoint
    from ddp_accel.recovery import HELD_STEP, KEY, Launcher, held_by_every_survivor, take_place

    launcher = Launcher(["python", "train.py"], 3)
    launcher.start = lambda slot, **how: object()  # no process: the decision alone
    holds = {"step": 5, "global_batch": 12, "exact_micro_batch": 2, "held": True}
    assert launcher.regroup({"0": holds, "2": holds}, lost_at=1.0)
    plan = json.loads(launcher.store.get(f"{KEY}/generation_1"))
    assert plan["held"] == 5
    assert held_by_every_survivor({"0": holds, "2": {}}, 5) is None  # (its DataLoader worker lost: saved nothing)
    assert held_by_every_survivor({"0": holds, "2": {**holds, "held": False}}, 5) is None
    assert held_by_every_survivor({"0": holds, "2": {**holds, "step": 4}}, 5) is None
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", LOST_AT_VARIABLE):
        monkeypatch.setenv(name, "0")  # (restored after the test: take_place sets them)
    monkeypatch.setenv(SLOT, "2")
    monkeypatch.setenv(GENERATION, "1")
    take_place(1, plan)
    small = tmp_path / "held"
    small.mkdir()
    (small / "training_state.json").write_text(json.dumps({"step": 5}))
    HELD[:] = [HeldCheckpoint(tmp_path / "step_5", 5, {}, small)]
    checkpoints = Checkpoints(None, tmp_path)
    try:
        assert checkpoints.resolve("latest") == tmp_path / "step_5"  # no file of it yet
    finally:
        HELD.clear()
    assert HELD_STEP not in os.environ  # (once)

    def rescued(step: int, writer: int) -> Path:
        rescue = tmp_path / f".rescue_step_{step}"
        rescue.mkdir()
        (rescue / RESCUE_WRITER).write_text(str(writer))
        return rescue

    dead = subprocess.Popen(["true"])  # (a pid no process has now)
    dead.wait()
    rescued(3, dead.pid)  # its writer died mid-write: never renamed

    def written_later(rescue: Path) -> None:
        time.sleep(0.5)
        (rescue / RESCUE_WRITER).unlink()
        complete(rescue, tmp_path / "step_7", json.dumps({"step": 7, "epoch": 0, "samples_in_epoch": 0}), None)

    writer = threading.Thread(target=written_later, args=(rescued(7, os.getpid()),))
    writer.start()
    started = time.monotonic()
    assert checkpoints.resolve("latest") == tmp_path / "step_7"  # after its write, not the last one complete before
    assert time.monotonic() - started >= 0.4
    writer.join()


@pytest.mark.inprocess
def test_replacements_are_told_the_step_the_survivors_hold_whether_they_start_at_once_or_join_at_a_hand_back(
    monkeypatch,
):
    # the survivors keep their copy of the step (after a loss, and at a hand-back): the plan names it, and a
    # replacement, started at once or called in later, is given it by a peer instead of reading its files
    from ddp_accel import recovery

    class Process:
        def __init__(self, command, env, **how):
            self.env, self.pid = env, os.getpid()  # (a pid that runs)

        def send_signal(self, signum):
            pass

        def poll(self):
            return None

    monkeypatch.setattr(recovery.subprocess, "Popen", Process)
    holds = {"step": 5, "global_batch": 12, "exact_micro_batch": 0, "held": True}
    launcher = recovery.Launcher(["python", "train.py"], 3)
    assert launcher.regroup({"0": holds, "2": holds}, lost_at=1.0)  # no pieces: a replacement at once
    assert json.loads(launcher.store.get(f"{recovery.KEY}/generation_1"))["held"] == 5
    assert launcher.running["1"].env[recovery.HELD_STEP] == "5"
    launcher = recovery.Launcher(["python", "train.py"], 3)
    holds["exact_micro_batch"] = 2
    assert launcher.regroup({"0": holds, "2": holds}, lost_at=1.0)  # the survivors go on, a replacement waits
    assert recovery.HELD_STEP not in launcher.joining["1"][0].env  # (told once called in: take_place)
    launcher.running = {"0": Process([], {}), "2": Process([], {})}
    for slot in ("0", "2"):  # each survivor's report at the hand-back: it kept its copy of step 9
        launcher.store.set(f"{recovery.KEY}/saved_1/{slot}", json.dumps({**holds, "step": 9}))
    assert launcher.hand_back()
    plan = json.loads(launcher.store.get(f"{recovery.KEY}/generation_2"))
    assert plan["held"] == 9 and plan["members"] == ["0", "1", "2"], plan


@pytest.mark.inprocess
def test_each_slot_keeps_its_own_gpu_whatever_rank_it_takes_and_a_replacement_takes_the_lost_one_s(monkeypatch):
    # LOCAL_RANK follows the rank in each new group (Accelerate's local main process is rank 0's): the device
    # must not, or a survivor moves to another GPU (the lost rank's, maybe the one that failed)
    import torch

    from ddp_accel import recovery

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")  # accelerate's gpu_ids
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # (CUDA's count of the visible ones)
    launcher = recovery.Launcher(["python", "train.py"], 3)
    started = {}
    monkeypatch.setattr(recovery.subprocess, "Popen", lambda command, env, **how: started.update({env[SLOT]: env}))
    for slot in launcher.members:
        launcher.start(slot)
    assert [started[slot]["CUDA_VISIBLE_DEVICES"] for slot in "012"] == ["3", "5", "7"]
    facts = {"step": 5, "global_batch": 12, "exact_micro_batch": 4}  # 2 survivors cannot keep the pieces
    assert launcher.regroup({"0": facts, "2": facts}, lost_at=1.0)  # slot 1 lost: its replacement starts
    assert started["1"]["CUDA_VISIBLE_DEVICES"] == "5" and started["1"]["RANK"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,7")  # CUDA stops at 7 on a 2-GPU machine: it sees 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert recovery.slot_devices(3) is None and recovery.slot_devices(2) == ["0", "1"]  # fewer: Accelerate shares
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert recovery.slot_devices(2) is None


class Ended:
    """A launched process as the launcher sees it: running for `polls` polls, then ended with `code`."""

    def __init__(self, code: int, polls: int = 0):
        self.code, self.polls, self.pid, self.returncode = code, polls, -1, None

    def poll(self):
        self.polls -= 1
        self.returncode = self.code if self.polls < 0 else None
        return self.returncode

    def wait(self, timeout=None):
        return self.code

    terminate = kill = send_signal = lambda self, *signal: None


@pytest.mark.inprocess
@pytest.mark.parametrize("completed", [True, False])
def test_a_loss_after_rank_0_completed_ends_the_job_whole_whatever_order_the_exits_are_seen_in(completed, capsys):
    # rank 2 killed at the end's barrier; rank 1 (listed first) ended 1 for it, rank 0 ended 0: only rank 0's word
    # that its run completed (not a preemption's exit 0) makes the job whole
    from ddp_accel.recovery import KEY, Launcher

    launcher = Launcher(["python", "train.py"], 3)
    launcher.start = lambda slot, **how: pytest.fail("a replacement started after the run ended")
    launcher.running = {"1": Ended(1), "2": Ended(-9), "0": Ended(0)}
    if completed:
        launcher.store.set(f"{KEY}/completed_0", "1")
    assert launcher.watch() == (0 if completed else 1)
    err = capsys.readouterr().err
    assert ("the run had ended (rank 0 done): nothing to recover" in err) is completed, err
    assert "rank 2 ended by SIGKILL" in err


@pytest.mark.inprocess
def test_every_process_failing_in_a_collective_with_none_lost_ends_the_job_instead_of_regrouping_again(capsys):
    # (an error that comes back at every start, DDP's first broadcast: no step reported, no process lost)
    from ddp_accel.recovery import Launcher

    launcher = Launcher(["python", "train.py"], 2)
    assert not launcher.regroup({"0": {}, "1": {}}, lost_at=1.0) and launcher.generation == 0
    assert "every process failed in a collective, and none was lost" in capsys.readouterr().err
    facts = {"step": 5, "global_batch": 8, "exact_micro_batch": 0}  # a DataLoader worker lost: its peer's step
    assert launcher.regroup({"0": facts, "1": {}}, lost_at=1.0) and launcher.generation == 1
    assert "generation 1: the 2 processes go on at step 5" in capsys.readouterr().err


@pytest.mark.inprocess
def test_a_process_that_fails_on_its_own_while_its_peer_reports_it_lost_ends_the_job_with_its_code(monkeypatch):
    # the failed process closes its connections before it exits: its peer reports a lost peer while it still runs,
    # but it was not cut off: its error (a user error, exit 2) is the job's, as without in-process recovery
    from ddp_accel.recovery import KEY, Launcher

    launcher = Launcher(["python", "train.py"], 2, stopped_timeout_s=5)
    launcher.start = lambda slot, **how: pytest.fail("a replacement started for a process that failed on its own")
    launcher.running = {"0": Ended(0, polls=1000), "1": Ended(2, polls=1)}  # rank 1 ends at its second poll
    launcher.store.set(f"{KEY}/saved_0/0", json.dumps({"step": 3, "global_batch": 8, "exact_micro_batch": 0}))
    launcher.store.add(f"{KEY}/reported_0", 1)
    assert launcher.watch() == 2
    # an earlier loss's collateral error (a survivor that ended while the group re-formed) is not a later one's
    launcher.error_code, launcher.generation = 1, 1
    launcher.start = lambda slot, **how: Ended(0, polls=1000)
    launcher.running = {"0": Ended(0, polls=1000), "1": Ended(0, polls=1000)}
    launcher.store.set(f"{KEY}/saved_1/0", json.dumps({"step": 5, "global_batch": 8, "exact_micro_batch": 0}))
    launcher.stopped_timeout_s = 0.1  # rank 1 is silent: cut off, and replaced
    assert launcher.recover(None) and launcher.generation == 2


def recovering_launch(output_dir: Path, processes: int, *args, options: tuple = ()) -> subprocess.Popen:
    log = open(output_dir.with_suffix(".log"), "w")
    command = [
        str(BIN / "ddp-accel"),
        "launch",
        "--recover",
        "in-process",
        *options,
        "--num_processes",
        str(processes),
        PROBE,
        "--output-dir",
        str(output_dir),
        *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def probes_of_slot(slot: int) -> list[int]:
    found = []
    for pid in parents():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{SLOT}={slot}".encode() in environ and b"probe.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
            found.append(pid)
    return found


def kill_slot_after_some_steps(launcher: subprocess.Popen, output_dir: Path, slot: int) -> None:
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "train:" in log_file.read_text(), alive=launcher, what="the training")
    time.sleep(1.5)  # some steps in
    os.kill(wait_for(lambda: probes_of_slot(slot))[0], signal.SIGKILL)


def finish(launcher: subprocess.Popen, output_dir: Path) -> tuple[int, str]:
    try:
        code = launcher.wait(timeout=300)
    finally:
        kill_tree(launcher)
    return code, output_dir.with_suffix(".log").read_text()


@pytest.mark.multiprocess
def test_survivors_go_on_with_a_killed_rank_s_share_until_its_replacement_takes_it_back_bitwise(tmp_path):
    # 3 x 4 with pieces of 2: the 2 survivors go on with 6 samples each (the same global batch, the same pieces);
    # a replacement starts meanwhile and, its imports done, joins at a step every process saves
    job = ["--train-size", "96", "--epochs", "16", "--exact-micro-batch", "2", "--checkpointing-steps", "1000"]
    reference = tmp_path / "reference"
    check = run_script(PROBE, *job, "--batch-size", "12", "--output-dir", reference)  # one process, the same gradient
    assert check.returncode == 0, check.stderr[-3000:]
    output_dir = tmp_path / "recovered"
    launcher = recovering_launch(output_dir, 3, *job, "--batch-size", "4", "--step-ms", "60", "--hang-timeout-s", "30")
    # rank 0: the ordered sum passes a total from rank to rank, so only rank 1's call fails; rank 2 waits on rank 1
    # until rank 1 leaves the group (its sockets closed)
    kill_slot_after_some_steps(launcher, output_dir, slot=0)
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "generation 1: 2 survivors go on at step" in log and "6 samples each" in log, log[-3000:]
    assert "generation 2: 1 replacement(s) take their share back" in log, log[-3000:]
    assert "generation 1's first step done" in log and "s after the loss" in log, log[-3000:]
    assert "generation 2's first step done" in log and "s after the call for its replacements" in log, log[-3000:]
    # each survivor's copy of the step, not read back: after the loss, and at the hand-back, where the replacement
    # is given a survivor's (no file of that step read: it is written in the background)
    assert log.count("states from its memory") == 4, log[-3000:]
    assert log.count("process 0: the models' and optimizers' states from process 1 (given)") == 1, log[-3000:]
    assert "in the background (its replacements are given it by a peer)" in log, log[-3000:]
    assert log.count("== ddp_accel ==") == 3, log[-3000:]  # the first group's banner, and each new group's
    assert "done: 128 steps" in log and "on 3 process(es)" in log, log[-3000:]
    assert_same_weights(reference, output_dir)
    assert not (output_dir / "preempted.json").exists()  # the hand-back's save is no stop
    assert not any(probes_of_slot(slot) for slot in range(3))  # nothing left running


@pytest.mark.multiprocess
def test_a_replacement_joins_where_the_survivors_cannot_keep_the_sum_s_order(standard_reference, tmp_path):
    # without --exact-micro-batch DDP's sum depends on the world size: a new process takes the lost rank's place;
    # rank 0 is the one lost (the store is the launcher's: nothing of the group's meeting place goes with it)
    output_dir = tmp_path / "replaced"
    launcher = recovering_launch(
        output_dir, 2, *STANDARD_PROBE_ARGS, "--step-ms", "40", "--checkpointing-steps", "1000"
    )
    kill_slot_after_some_steps(launcher, output_dir, slot=0)
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "rank 0 ended by SIGKILL" in log and "1 replacement(s) join the 1 survivors" in log, log[-3000:]
    assert "writes the step it reached in the background" in log, log[-3000:]
    assert log.count("states from its memory") == 1, log[-3000:]  # the survivor's; the replacement, rank 0 again,
    assert log.count("process 0: the models' and optimizers' states from process 1 (given)") == 1, log[-3000:]  # its
    assert_same_weights(standard_reference, output_dir)


def loader_workers_of_slot(slot: int) -> list[int]:
    """The DataLoader workers of a slot's process: the children of its workers' forkserver."""
    ranks = [pid for pid in probes_of_slot(slot) if "ddp-accel" in Path(f"/proc/{parents()[pid]}/cmdline").read_text()]
    tree = process_tree(ranks[0]) if ranks else []
    return [pid for pid in tree if parents().get(pid) in tree and parents()[pid] != ranks[0]]


@pytest.mark.multiprocess
def test_a_spare_whose_imports_are_done_takes_a_lost_rank_s_place_at_once_and_another_starts_bitwise(
    standard_reference, tmp_path
):
    output_dir = tmp_path / "spared"
    launcher = recovering_launch(
        output_dir,
        2,
        *STANDARD_PROBE_ARGS,
        "--step-ms",
        "40",
        "--checkpointing-steps",
        "1000",
        options=("--spares", "1"),
    )
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "a spare is ready (pid" in log_file.read_text(), alive=launcher, what="the spare's imports")
    spare = probes_of_slot("spare")[0]
    assert f"a spare is ready (pid {spare})" in log_file.read_text()
    kill_slot_after_some_steps(launcher, output_dir, slot=1)
    wait_for(lambda: "takes the place of slot 1" in log_file.read_text(), alive=launcher, what="the spare's call")
    os.kill(spare, 0)  # the spare is slot 1 now (no process started after the loss), and another spare waits
    assert wait_for(lambda: [pid for pid in probes_of_slot("spare") if pid != spare], alive=launcher, what="a spare")
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert f"a spare (pid {spare}, its imports done) takes the place of slot 1" in log, log[-3000:]
    assert "1 replacement(s) join the 1 survivors" in log and "generation 1's first step done" in log, log[-3000:]
    assert log.count("process 1: the models' and optimizers' states from process 0 (given)") == 1, log[-3000:]
    assert_same_weights(standard_reference, output_dir)
    assert not probes_of_slot("spare") and not any(probes_of_slot(slot) for slot in range(2))  # nothing left


@pytest.mark.multiprocess
def test_a_killed_dataloader_worker_costs_its_group_a_regroup_at_the_step_reached_bitwise(standard_reference, tmp_path):
    # the OOM killer's usual victim: the process whose worker it was saves the step reached and leaves the group;
    # the same processes go on in the next one, with new workers (no process replaced, no job ended)
    output_dir = tmp_path / "worker"
    job = [*STANDARD_PROBE_ARGS, "--step-ms", "40", "--workers", "1", "--persistent-workers"]
    launcher = recovering_launch(output_dir, 2, *job, "--checkpointing-steps", "1000")
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "step 32: eval_loss" in log_file.read_text(), alive=launcher, what="the first epoch")
    os.kill(wait_for(lambda: loader_workers_of_slot(1))[0], signal.SIGKILL)  # (persistent: the epoch's own)
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "process 1: DataLoader worker (pid" in log and "the group goes on in a new one" in log, log[-3000:]
    assert "generation 1: the 2 processes go on at step" in log, log[-3000:]
    assert "writes the step it reached in the background" in log and "replacement" not in log, log[-3000:]
    assert_same_weights(standard_reference, output_dir)


@pytest.mark.multiprocess
def test_under_fsdp_the_survivor_keeps_its_process_and_resumes_from_the_last_checkpoint_bitwise(tmp_path):
    # no survivor holds the lost rank's shards: the step reached is not saved (said in one line), and the new
    # group, the survivor and a replacement, resumes from the last complete checkpoint: the steps since are redone
    fsdp = ["--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml")]
    job = ["--dropout", "0", "--train-size", "96", "--epochs", "4", "--checkpointing-steps", "5", "--batch-size", "4"]
    job += ["--mixed-precision", "no"]
    reference = tmp_path / "reference"
    check_ok(launch(PROBE, *job, "--output-dir", reference, config=ROOT / "accelerate_configs" / "fsdp.yaml"))
    output_dir = tmp_path / "recovered"
    launcher = recovering_launch(output_dir, 2, *job, "--step-ms", "60", options=tuple(fsdp))
    kill_slot_after_some_steps(launcher, output_dir, slot=1)
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "the restart resumes from the last checkpoint (FSDP: no rank holds another's shard)" in log, log[-3000:]
    assert "1 replacement(s) join the 1 survivors" in log and "resumed from" in log, log[-3000:]
    assert_same_weights(reference, output_dir)


@pytest.mark.multiprocess
def test_a_second_loss_while_the_group_forms_gives_that_group_up_and_the_next_one_ends_bitwise(tmp_path):
    # 3 x 4 in pieces of 4: 2 survivors cannot keep the sum's pieces, so a replacement joins at once; while it
    # starts (seconds of imports) the survivors wait to meet it, and one of them is killed there too. The other
    # must not wait for it inside torch's rendezvous: the launcher gives that generation up and forms the next.
    job = ["--train-size", "96", "--epochs", "12", "--exact-micro-batch", "4", "--checkpointing-steps", "1000"]
    reference = tmp_path / "reference"
    check = run_script(PROBE, *job, "--batch-size", "12", "--output-dir", reference)
    assert check.returncode == 0, check.stderr[-3000:]
    output_dir = tmp_path / "recovered"
    timeouts = ["--hang-timeout-s", "30", "--timeout-s", "60"]  # a wait on the dead peer: a failure within a minute
    launcher = recovering_launch(output_dir, 3, *job, "--batch-size", "4", "--step-ms", "60", *timeouts)
    kill_slot_after_some_steps(launcher, output_dir, slot=1)
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "generation 1: 1 replacement(s) join" in log_file.read_text(), alive=launcher, timeout=60)
    os.kill(probes_of_slot(2)[0], signal.SIGKILL)  # a survivor, waiting for the replacement to meet it
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "rank 2 ended by SIGKILL" in log and "generation 2: 1 replacement(s) join the 2 survivors" in log, log
    assert_same_weights(reference, output_dir)
    assert not any(probes_of_slot(slot) for slot in range(3))


@pytest.mark.multiprocess
def test_a_loss_while_a_new_group_starts_its_main_regroups_from_the_last_checkpoint_bitwise(tmp_path):
    # the group formed (each process built its Accelerator again) and a survivor is killed before the first step:
    # the other's collective fails in the script's start (DDP's broadcast, the resume), outside the training loop
    job = ["--train-size", "96", "--epochs", "12", "--exact-micro-batch", "2", "--checkpointing-steps", "1000"]
    reference = tmp_path / "reference"
    check = run_script(PROBE, *job, "--batch-size", "12", "--output-dir", reference)
    assert check.returncode == 0, check.stderr[-3000:]
    output_dir, pids = tmp_path / "recovered", tmp_path / "pids"
    options = ["--step-ms", "60", "--hang-timeout-s", "30", "--timeout-s", "60", "--pid-dir", pids]
    launcher = recovering_launch(output_dir, 3, *job, "--batch-size", "4", *options)
    slot_2 = wait_for(lambda: probes_of_slot(2))[0]
    kill_slot_after_some_steps(launcher, output_dir, slot=1)
    wait_for(lambda: (pids / f"rank1.{slot_2}").exists(), alive=launcher, interval=0.01, timeout=60)
    os.kill(slot_2, signal.SIGKILL)  # slot 2, rank 1 of generation 1, as the group's main starts
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "process 0: a peer was lost outside the training steps" in log, log[-3000:]
    assert "1 survivors go on from the last checkpoint, 12 samples each" in log, log[-3000:]
    assert_same_weights(reference, output_dir)
    assert not any(probes_of_slot(slot) for slot in range(3))


@pytest.mark.multiprocess
def test_a_loss_after_the_run_ended_is_no_failure_once_rank_0_wrote_the_outputs(tmp_path):
    # every process trained to the end and rank 0 wrote the outputs; rank 1 is killed before the group's last
    # barrier: the others' barrier fails, rank 0's outputs are whole, and there is nothing to recover
    output_dir = tmp_path / "ended"
    launcher = recovering_launch(output_dir, 3, "--train-size", "48", "--epochs", "1", "--linger-s", "3")
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "probe rank 1 " in log_file.read_text() and "done:" in log_file.read_text(), alive=launcher)
    os.kill(probes_of_slot(1)[0], signal.SIGKILL)
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "process 0: a peer was lost after the run ended; its outputs are whole" in log, log[-3000:]
    assert "error: process 2: a peer was lost at the run's end" in log, log[-3000:]
    assert "the run had ended (rank 0 done): nothing to recover" in log and "Traceback" not in log, log[-3000:]
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "metrics.json").is_file()
    assert not any(probes_of_slot(slot) for slot in range(3))


@pytest.mark.multiprocess
def test_a_rank_stopped_past_the_bound_is_ended_and_replaced_and_the_run_ends_bitwise(standard_reference, tmp_path):
    # SIGSTOP: alive, but its peers wait for it in a collective (a stuck driver); the launcher sees it stopped
    output_dir = tmp_path / "stopped"
    launcher = recovering_launch(
        output_dir, 2, *STANDARD_PROBE_ARGS, "--step-ms", "40", options=("--stopped-timeout-s", "2")
    )
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "train:" in log_file.read_text(), alive=launcher, what="the training")
    time.sleep(1.5)  # some steps in
    os.kill(wait_for(lambda: probes_of_slot(1))[0], signal.SIGSTOP)
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "rank 1 stopped for 2 s (SIGSTOP, a stuck driver): ended" in log, log[-3000:]
    assert "1 replacement(s) join the 1 survivors" in log, log[-3000:]
    assert_same_weights(standard_reference, output_dir)


@pytest.mark.multiprocess
def test_a_rank_cut_off_in_a_deadlock_is_ended_once_its_peer_s_collective_timed_out_and_the_run_ends_bitwise(
    standard_reference, tmp_path
):
    # reading a sample blocks forever (once): that rank is alive and silent; its peer's all-reduce times out after
    # --timeout-s (below the watchdog's bound; it also bounds the wait for the replacement's start), the peer saves
    # the step reached and reports, and the launcher ends the silent one after --stopped-timeout-s and replaces it
    output_dir = tmp_path / "cut_off"
    job = [*STANDARD_PROBE_ARGS, "--step-ms", "40", "--hang-at-sample", "200", "--timeout-s", "15"]
    launcher = recovering_launch(output_dir, 2, *job, "--hang-timeout-s", "120", options=("--stopped-timeout-s", "2"))
    code, log = finish(launcher, output_dir)
    assert code == 0, log[-3000:]
    assert "a process left its group while every process runs; recovering in process" in log, log[-3000:]
    assert "silent for 2 s while its peers reported (cut off: a deadlock, a wait in the kernel): ended" in log, log
    assert "1 replacement(s) join the 1 survivors" in log and "writes the step it reached in the background" in log, (
        log[-3000:]
    )
    assert (output_dir / "hung_once").exists()  # (the sample did block)
    assert_same_weights(standard_reference, output_dir)
    assert not any(probes_of_slot(slot) for slot in range(2))


@pytest.mark.inprocess
def test_in_process_recovery_refuses_more_than_one_machine_or_an_engine_with_groups_of_its_own_in_one_line(
    capsys, monkeypatch
):
    from ddp_accel import recovery
    from ddp_accel.launch import main

    assert main(["--recover", "in-process", "--num_machines", "2", "--num_processes", "4", PROBE]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --recover in-process runs the processes of one machine: give num_machines 1"
    )
    monkeypatch.setattr(recovery, "launch", lambda *how: 0)  # (nothing launched where the refusal is missing)
    assert main(["--recover", "in-process", "--use_deepspeed", "--num_processes", "2", PROBE]) == 2
    assert "DeepSpeed's and Megatron-LM's engines keep groups of their own" in capsys.readouterr().err
    fsdp2 = ["--use_fsdp", "--fsdp_version", "2", "--num_processes", "2"]
    assert main(["--recover", "in-process", *fsdp2, "--parallelism_config_dp_shard_size", "2", PROBE]) == 0
    tensor_parallel = ["--use_parallelism_config", "--parallelism_config_tp_size", "2"]
    assert main(["--recover", "in-process", *fsdp2, *tensor_parallel, PROBE]) == 2
    assert "a parallelism_config fixes its sizes (tensor, context, data parallel)" in capsys.readouterr().err
    assert main(["--recover", "in-process", "--min-processes", "4", "--num_processes", "3", PROBE]) == 2
    assert "--min-processes 4 is more than the 3 processes launched" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--min-processes", "2", "--num_processes", "3", PROBE])
    assert "--min-processes, --stopped-timeout-s and --spares shape --recover in-process: give it" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["--spares", "1", "--num_processes", "3", PROBE])
    assert "--spares shape --recover in-process: give it" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the survivors would stop waiting for their next group first
        main(["--recover", "in-process", "--stopped-timeout-s", "200", "--num_processes", "3", PROBE])
    assert "--stopped-timeout-s: give less than 150 s" in capsys.readouterr().err


@pytest.mark.inprocess
def test_every_setting_accelerate_launch_gives_its_processes_reaches_the_recovering_launcher_s(tmp_path, monkeypatch):
    from ddp_accel import recovery
    from ddp_accel.launch import main

    config = tmp_path / "debug.yaml"
    config.write_text(
        "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\nmixed_precision: bf16\ndebug: true\n"
        "gpu_ids: 0,1\ndynamo_config:\n  dynamo_backend: INDUCTOR\n"
    )
    handed = {}
    monkeypatch.setattr(recovery, "launch", lambda command, processes, env, *rest: handed.update(env) or 0)
    threads = ["--num_cpu_threads_per_process", "3"]  # (a flag only)
    assert main(["--recover", "in-process", "--config_file", str(config), *threads, PROBE, "--epochs", "1"]) == 0
    assert handed["ACCELERATE_MIXED_PRECISION"] == "bf16" and handed["ACCELERATE_DEBUG_MODE"] == "true"
    assert handed["CUDA_VISIBLE_DEVICES"] == "0,1" and handed["OMP_NUM_THREADS"] == "3"
    assert handed["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    handed.clear()  # a flag over the file, as accelerate launch reads it
    flag = ["--mixed_precision", "fp16"]
    assert main(["--recover", "in-process", "--config_file", str(config), *flag, PROBE]) == 0
    assert handed["ACCELERATE_MIXED_PRECISION"] == "fp16"
    assert "NCCL_P2P_DISABLE" not in handed
    # GPUs whose P2P and InfiniBand NCCL must not use (accelerate launch's own check): both off, as it sets them
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "check_cuda_p2p_ib_support", lambda: False)
    handed.clear()
    assert main(["--recover", "in-process", "--config_file", str(config), PROBE]) == 0
    assert handed["NCCL_P2P_DISABLE"] == "1" and handed["NCCL_IB_DISABLE"] == "1"


@pytest.mark.inprocess
def test_the_recovering_launcher_reads_the_default_config_file_accelerate_config_writes(tmp_path, monkeypatch, capsys):
    # without --config_file accelerate launch reads the file `accelerate config` wrote: its process count, its
    # precision, and what the launcher refuses (more than one machine) come from there too
    import accelerate.commands.launch
    from accelerate.commands.config import config_args

    from ddp_accel import recovery
    from ddp_accel.launch import machine_setup, main

    default = tmp_path / "default_config.yaml"
    for module in (config_args, accelerate.commands.launch):
        monkeypatch.setattr(module, "default_config_file", str(default))
    default.write_text("distributed_type: MULTI_CPU\nnum_machines: 1\nnum_processes: 3\nmixed_precision: bf16\n")
    launched = []
    monkeypatch.setattr(
        recovery, "launch", lambda command, processes, env, *rest: launched.append((processes, env)) or 0
    )
    assert main(["--recover", "in-process", PROBE]) == 0
    assert launched[0][0] == 3 and launched[0][1]["ACCELERATE_MIXED_PRECISION"] == "bf16"
    default.write_text(
        default.read_text().replace("num_machines: 1\nnum_processes: 3", "num_machines: 2\nnum_processes: 4")
    )
    assert main(["--recover", "in-process", PROBE]) == 2
    assert "runs the processes of one machine: give num_machines 1" in capsys.readouterr().err
    assert machine_setup([PROBE])["machines"] == 2  # (the restart's launcher waits for every machine it names)


def launcher_store(monkeypatch, world: int):
    """A launcher's store, and this process as rank 0 of a group of `world` meeting there."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0", "WORLD_SIZE": str(world)}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return store


@pytest.mark.inprocess
def test_a_spare_called_in_takes_the_lost_slot_and_its_rank(monkeypatch):
    from ddp_accel import recovery

    store = launcher_store(monkeypatch, 3)
    for name in (
        GENERATION,
        recovery.HELD_STEP,
        recovery.LOST_AT,
        recovery.CALLED_AT,
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    ):
        monkeypatch.setenv(name, "")  # what the call sets, unset again after the test
        monkeypatch.delenv(name)
    store.set(f"{recovery.KEY}/generation_2", json.dumps({"members": ["0", "2", "1"], "batch_size": 4, "held": 7}))
    monkeypatch.setenv(SLOT, recovery.SPARE)
    monkeypatch.setenv(recovery.JOINS, "5")
    monkeypatch.setenv(recovery.LAUNCHER, str(os.getppid()))  # (this process plays the launcher's child)
    store.set(f"{recovery.KEY}/called/5", json.dumps({"generation": 2, "slot": "1"}))
    recovery.wait_to_be_called(5)
    assert store.check([f"{recovery.KEY}/ready/5"])  # it said its imports were done
    assert (os.environ[SLOT], os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ[GENERATION]) == (
        "1",
        "2",
        "3",
        "2",
    )
    assert os.environ[recovery.HELD_STEP] == "7" and recovery.JOINS not in os.environ


class Running:
    """A started process that runs until the test ends."""

    def __init__(self, command, env, **how):
        self.env, self.pid, self.returncode = env, 4242, None

    def poll(self):
        return None


@pytest.mark.inprocess
def test_a_spare_keeps_its_own_gpu_in_the_lost_slot_and_the_next_spare_starts_on_the_lost_one_s(monkeypatch, capsys):
    import torch

    from ddp_accel import recovery

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    started: list[Running] = []
    monkeypatch.setattr(
        recovery.subprocess, "Popen", lambda *args, **how: started.append(Running(*args, **how)) or started[-1]
    )
    launcher = recovery.Launcher(["python", "train.py"], 2, spares=1)
    for slot in launcher.members:
        launcher.running[slot] = launcher.start(slot)
    launcher.spares.fill()
    assert [(process.env[SLOT], process.env["CUDA_VISIBLE_DEVICES"]) for process in started] == [
        ("0", "3"),
        ("1", "5"),
        (recovery.SPARE, "7"),
    ]
    launcher.store.set(f"{recovery.KEY}/ready/{started[2].env[recovery.JOINS]}", "1")  # its imports done
    facts = {"step": 5, "global_batch": 8, "exact_micro_batch": 0}
    assert launcher.regroup({"0": facts}, lost_at=1.0)  # slot 1 lost: the spare takes it, another starts
    assert launcher.running["1"] is started[2] and launcher.devices == ["3", "7", "5"]
    assert (started[3].env[SLOT], started[3].env["CUDA_VISIBLE_DEVICES"]) == (recovery.SPARE, "5")
    call = json.loads(launcher.store.get(f"{recovery.KEY}/called/{started[2].env[recovery.JOINS]}"))
    assert call == {"generation": 1, "slot": "1"}
    assert "a spare (pid 4242, its imports done) takes the place of slot 1" in capsys.readouterr().err
    # with pieces the survivors divide, a ready spare joins at once too (the group keeps its size: no hand-back)
    exact = recovery.Launcher(["python", "train.py"], 2, spares=1)
    exact.running = {slot: exact.start(slot) for slot in exact.members}
    exact.spares.fill()
    exact.store.set(f"{recovery.KEY}/ready/{started[-1].env[recovery.JOINS]}", "1")
    assert exact.regroup({"1": {"step": 9, "global_batch": 8, "exact_micro_batch": 2}}, lost_at=2.0)
    assert exact.running["0"].env[SLOT] == recovery.SPARE and not exact.joining
    assert "generation 1: 1 replacement(s) join the 1 survivors at step 9" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a GPU for each process, none for a spare
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert recovery.launch(["train.py"], 2, spares=1) == 2
    assert "a spare needs a GPU of its own from its start: 3 GPUs for 2 processes" in capsys.readouterr().err


@pytest.mark.inprocess
def test_the_ordered_sum_s_wait_on_a_peer_ends_at_the_launcher_s_word_that_a_peer_was_lost(monkeypatch):
    # gloo does not always tell a process waiting on a peer that the peer is gone (a receive whose sender died
    # mid-message waits until --timeout-s): under in-process recovery the ordered sum's waits read the launcher's word
    import torch.distributed as dist

    from ddp_accel.endings import lost_peers
    from ddp_accel.exact_reduction import wait_watching_the_launcher
    from ddp_accel.recovery import KEY

    store = launcher_store(monkeypatch, world=1)
    monkeypatch.setenv(GENERATION, "3")

    class Work:
        """A wait on a peer: done at once, or (a peer gone) only at the timeout, 3 s in."""

        def __init__(self, done: bool):
            self.done, self.times_out_at, self.waited = done, time.monotonic() + 3, False

        def is_completed(self):
            return self.done or time.monotonic() > self.times_out_at

        def wait(self):
            assert self.done, "waited on a peer that was gone until the timeout"
            self.waited = True

    done = Work(done=True)
    wait_watching_the_launcher(done)
    assert done.waited
    word = threading.Timer(0.3, lambda: store.set(f"{KEY}/abandoned_3", "1"))  # the launcher saw a process die
    word.start()
    with pytest.raises(dist.DistNetworkError, match="a peer was lost") as lost:
        wait_watching_the_launcher(Work(done=False), every_s=0.05)
    assert lost_peers(lost.value)  # the survivor's path: it saves the step reached and reports
    word.join()


@pytest.mark.multiprocess
def test_survivors_of_a_rank_killed_in_the_middle_of_a_message_end_their_wait_at_the_launcher_s_word():
    # gloo's own wait: rank 2's receive of the total rank 1 was sending, and rank 0's broadcast, until the group's
    # timeout (20 s); the ordered sum's under in-process recovery: at once once the launcher saw rank 1 die
    said = said_after_the_launcher_s_word(*ranks_of("chain_rank.py", "chain"), killed=1)
    for rank, text in said.items():
        assert f"rank {rank}: DistNetworkError after" in text and "a peer was lost" in text, text[-2000:]


def ranks_of(script: str, mode: str) -> tuple[Any, list[subprocess.Popen]]:
    """3 processes of `script` (tests/) in `mode`, meeting at a store of this test's, generation 0."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), GENERATION: "0"}
    command = [str(BIN / "python"), str(ROOT / "tests" / script)]
    output = {"text": True, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    return store, [subprocess.Popen([*command, str(rank), mode], env=env, **output) for rank in range(3)]


def said_after_the_launcher_s_word(store: Any, ranks: list[subprocess.Popen], killed: int) -> dict[int, str]:
    """Once rank `killed` died (its SIGKILL, in its script), the launcher's word that a peer was lost; then what
    each other rank said."""
    from ddp_accel.recovery import KEY

    try:
        assert ranks[killed].wait(timeout=120) == -signal.SIGKILL, ranks[killed].stdout.read()
        store.set(f"{KEY}/abandoned_0", "1")  # what the launcher does once it reaped a process
        return {rank: process.communicate(timeout=60)[0] for rank, process in enumerate(ranks) if rank != killed}
    finally:
        for process in ranks:
            process.kill()


@pytest.mark.multiprocess
def test_a_process_without_the_step_is_given_the_first_holder_s_copy_bitwise_whatever_it_holds():
    # a replacement joining survivors that hold the step: the first holder's copy, every tensor's bytes (bfloat16,
    # bool, 0-d, empty), a tensor held twice still one, a state dict's metadata, the optimizer's groups and the
    # small files; the holders keep their own
    _, ranks = ranks_of("peer_copy_rank.py", "whole")
    try:
        said = [process.communicate(timeout=120)[0] for process in ranks]
    finally:
        for process in ranks:
            process.kill()
    assert [process.returncode for process in ranks] == [0, 0, 0], said
    expected = (
        "bitwise True, tied True, OrderedDict {'': {'version': 2}}, groups [{'lr': 0.1, 'betas': (0.9, 0.99), "
        "'params': [0]}], small {'scheduler.bin': b'\\x00\\x01small'}"
    )
    for rank, giver, own in ((0, 0, True), (1, 1, True), (2, 0, False)):
        assert f"rank {rank}: from {giver}, {expected}; its own {own}" in said[rank], said


@pytest.mark.multiprocess
def test_receivers_of_a_giver_killed_in_the_middle_of_its_copy_end_their_wait_at_the_launcher_s_word():
    said = said_after_the_launcher_s_word(*ranks_of("peer_copy_rank.py", "giver_lost"), killed=0)
    for rank, text in said.items():
        assert f"rank {rank}: DistNetworkError after" in text and "a peer was lost" in text, text[-2000:]


@pytest.mark.inprocess
def test_each_generation_forms_its_group_on_keys_no_earlier_generation_wrote(monkeypatch):
    # a group's keys (each rank's gloo address) have the same names in every generation: read from an earlier
    # one, they name a rank that is gone ("Gloo connectFullMesh failed ... Connection refused")
    import torch.distributed as dist

    from ddp_accel import runtime

    _held = launcher_store(monkeypatch, world=1)  # (the store serves while it is held)
    formed = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, store, **how: formed.append(store))
    for generation in ("0", "1"):
        monkeypatch.setenv(GENERATION, generation)
        runtime.init_elastic_process_group(cpu=True, timeout_s=10)
    formed[0].set("rank_0", "the address of a process lost since")
    assert formed[0].check(["rank_0"]) and not formed[1].check(["rank_0"])


@pytest.mark.inprocess
def test_a_member_lost_after_the_meeting_but_before_its_connections_makes_its_peers_regroup(monkeypatch):
    # every member met; one is killed before it wrote its address: the others' connections wait for it in the
    # launcher's store until --timeout-s; then they see the launcher gave the group up, and regroup
    import torch.distributed as dist

    from ddp_accel import recovery, runtime

    store = launcher_store(monkeypatch, world=2)
    monkeypatch.setenv(GENERATION, "3")
    store.add(f"{recovery.KEY}/arrived_3", 1)  # the other member arrived, and is lost once this one met it:
    lost = threading.Timer(0.5, store.set, (f"{recovery.KEY}/abandoned_3", "1"))  # (the launcher, on its loss)
    lost.start()
    started = time.monotonic()
    with pytest.raises(recovery.Regroup, match="lost before the group formed"):
        runtime.init_elastic_process_group(cpu=True, timeout_s=3)
    assert time.monotonic() - started < 30 and not dist.is_initialized()
    lost.join()


@pytest.mark.multiprocess
def test_processes_whose_recovering_launcher_is_killed_save_the_step_reached_and_end(tmp_path):
    # the processes run in sessions of their own (a Ctrl-C reaches them once, from the launcher): a SIGKILL of the
    # launcher alone must not leave them training on; they see their parent gone, save the step reached and end
    output_dir = tmp_path / "orphaned"
    launcher = recovering_launch(output_dir, 2, *STANDARD_PROBE_ARGS, "--step-ms", "40")
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "train:" in log_file.read_text(), alive=launcher, what="the training")
    processes = wait_for(lambda: [pid for slot in (0, 1) for pid in probes_of_slot(slot)] or None)
    time.sleep(1.0)  # some steps in
    launcher.kill()
    launcher.wait()
    try:
        wait_for(lambda: not any(probes_of_slot(slot) for slot in (0, 1)), timeout=60, what="the processes to end")
    finally:
        for pid in [pid for slot in (0, 1) for pid in probes_of_slot(slot)]:
            os.kill(pid, signal.SIGKILL)
    log = log_file.read_text()
    assert "its launcher (pid" in log and len(processes) == 2, log[-3000:]
    assert (output_dir / "preempted.json").is_file(), log[-3000:]  # the step reached, saved for the same command
