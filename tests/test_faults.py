"""Faults from outside the training code: SIGKILL a worker (torchrun restarts the group, training resumes from
the last complete checkpoint and ends with bitwise the same weights), kill one mid-checkpoint, hang one."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    BIN,
    ROOT,
    STANDARD_PROBE_ARGS,
    assert_same_weights,
    check_ok,
    checkpoint_steps,
    rank_of,
    run_script,
    wait_for,
    weights,
    workers,
)

PROBE = str(ROOT / "tests" / "probe.py")
COMMON = STANDARD_PROBE_ARGS  # the standard job: 32 steps an epoch, 3 epochs, a checkpoint every 5 steps


def torchrun(
    output_dir: Path, *args, max_restarts: int = 0, env: dict | None = None, nproc: int = 2
) -> subprocess.Popen:
    log = open(output_dir.with_suffix(".log"), "w")
    # --standalone: the classic single-machine elastic recipe (a c10d rendezvous on localhost)
    command = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max_restarts",
        str(max_restarts),
        "--monitor_interval",
        "0.2",
        PROBE,
        "--output-dir",
        str(output_dir),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def finish(agent: subprocess.Popen, output_dir: Path, timeout: float = 300) -> tuple[int, str]:
    try:
        code = agent.wait(timeout=timeout)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    return code, output_dir.with_suffix(".log").read_text()


def resumed_steps(log: str) -> list[int]:
    return [int(line.split("step ")[1].split(",")[0]) for line in log.splitlines() if "resumed from" in line]


# --async-checkpoint: the write runs in a background thread while training goes on; under FSDP (the variables
# accelerate launch gives an FSDP config) its shards are written over the writers' own process group
WRITES = {
    "at-once": ([], {}),
    "async": (["--async-checkpoint"], {}),
    "fsdp-async": (["--async-checkpoint"], {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("writes", list(WRITES))
def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(standard_reference, tmp_path, writes):
    # the elastic agent restarts the group; under FSDP it resumes from the shards, and 2 ranks' FSDP steps are
    # bitwise DDP's (the gradients' average is a sum and an exact halving either way). at-once: the restarted group
    # then loses one worker mid-epoch (SIGKILL) and is restarted again: the same job, a second fault
    output_dir = tmp_path / "mid_save"
    extra, env = WRITES[writes]
    command = [*COMMON, "--step-ms", "20", *extra, "--resume-from-checkpoint", "latest"]
    agent = torchrun(output_dir, *command, max_restarts=2, env=env)
    log_file, checkpoints = output_dir.with_suffix(".log"), output_dir / "checkpoints"
    wait_for(lambda: 5 in checkpoint_steps(output_dir))  # one complete checkpoint to fall back on
    # the moment the next one is being written (its files go to .tmp_step_N until complete)
    partial = wait_for(lambda: next(iter(checkpoints.glob(".tmp_step_*")), None), interval=0.001)
    for pid in workers(agent):
        os.kill(pid, signal.SIGKILL)
    resumed = wait_for(lambda: resumed_steps(log_file.read_text()), timeout=120, alive=agent, what="the resume")[0]
    partial_step = int(partial.name.rsplit("_", 1)[1])
    # resumed from the newest *complete* checkpoint: the one being written counts only if it finished
    # before the kill landed
    line = next(line for line in log_file.read_text().splitlines() if "resumed from" in line)
    assert resumed < partial_step or resumed == partial_step and "step_" + str(partial_step) in line
    print(f"\nkilled while writing {partial.name}; resumed from step {resumed}", file=sys.stderr)
    if writes == "at-once":
        kill_one_worker_mid_epoch(agent, output_dir, after_step=resumed + 10)
    code, log = finish(agent, output_dir)
    assert code == 0, log[-3000:]
    assert len(resumed_steps(log)) == (2 if writes == "at-once" else 1), log[-3000:]
    assert_same_weights(standard_reference, output_dir)


def kill_one_worker_mid_epoch(agent: subprocess.Popen, output_dir: Path, after_step: int) -> None:
    """SIGKILL one worker once the checkpoint of `after_step` (within the first epoch's 32 steps) is complete: the
    agent restarts the group, which resumes from the newest complete checkpoint, not an older one."""
    log_file = output_dir.with_suffix(".log")
    resumes = len(resumed_steps(log_file.read_text()))
    wait_for(lambda: after_step in checkpoint_steps(output_dir), alive=agent, what=f"the checkpoint of {after_step}")
    victim = wait_for(lambda: workers(agent))[-1]
    os.kill(victim, signal.SIGKILL)
    killed_at, latest_at_kill = time.monotonic(), max(checkpoint_steps(output_dir))
    wait_for(lambda: len(resumed_steps(log_file.read_text())) > resumes, timeout=120, alive=agent, what="the resume")
    resumed_step = resumed_steps(log_file.read_text())[resumes]
    assert resumed_step >= latest_at_kill  # nothing older than the newest complete checkpoint
    print(
        f"\nkill -> resumed training: {time.monotonic() - killed_at:.1f} s; resumed from step {resumed_step} "
        f"(at most {5 - 1} steps redone with --checkpointing-steps 5)",
        file=sys.stderr,
    )


@pytest.mark.parametrize("fault", ["kill", "hang"])
@pytest.mark.multiprocess
def test_a_dead_or_hung_rank_ends_the_job_with_an_error(tmp_path, fault):
    """Without restarts: a killed rank is seen by the torchrun agent; a hung one (SIGSTOP) by the others'
    collective timeout (--timeout-s), after which they fail and the agent stops the job."""
    output_dir = tmp_path / fault
    agent = torchrun(output_dir, *COMMON, "--step-ms", "20", "--timeout-s", "8")
    wait_for(lambda: 5 in checkpoint_steps(output_dir))
    victim = workers(agent)[-1]
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    if fault == "hang":
        # the other rank gives up after --timeout-s with one line; then torch's agent would wait 30 s (its shutdown
        # timeout, which torch 2.14 ignores on this path) for the stopped rank to obey SIGTERM before it SIGKILLs it
        log_file = output_dir.with_suffix(".log")
        wait_for(lambda: "lost contact" in log_file.read_text(), timeout=8 + 60, what="the other rank's error line")
        os.kill(victim, signal.SIGKILL)
    code, log = finish(agent, output_dir, timeout=120)
    elapsed = time.monotonic() - started
    assert code != 0, log[-3000:]
    assert elapsed < 8 + 60, f"the job took {elapsed:.0f} s to end"
    print(f"\n{fault}: job ended with exit {code} {elapsed:.1f} s after the fault", file=sys.stderr)


def read_marker(output_dir: Path) -> dict | None:
    path = output_dir / "preempted.json"
    return json.loads(path.read_text()) if path.is_file() else None


@pytest.mark.parametrize("target", [pytest.param("agent", marks=pytest.mark.versions), "one_worker"])
@pytest.mark.multiprocess
def test_preemption_signal_saves_the_step_reached_and_resume_loses_nothing(standard_reference, tmp_path, target):
    """SIGTERM to torchrun's agent (it forwards it to every worker), or SIGUSR1 (SLURM's time-limit warning) to
    one worker only: the ranks agree at the next optimizer step, every rank saves the step reached.
    agent: every rank was signalled and exits 0; the same command again resumes from exactly that step.
    one_worker: the rank that was not signalled exits non-zero (stopped by a peer), so the agent, which was not
    signalled either, forms the group again (an elastic restart) and it resumes from exactly that step in place.
    Either way the run ends bitwise equal to an uninterrupted run."""
    output_dir = tmp_path / target
    command = [*COMMON, "--step-ms", "40", "--resume-from-checkpoint", "latest"]
    agent = torchrun(output_dir, *command, max_restarts=2)
    wait_for(lambda: 5 in checkpoint_steps(output_dir))
    time.sleep(0.3)  # mid-way between scheduled checkpoints
    signalled = time.monotonic()
    if target == "agent":
        agent.send_signal(signal.SIGTERM)
    else:
        os.kill(next(pid for pid in workers(agent) if rank_of(pid) == 1), signal.SIGUSR1)  # not rank 0's
    marker = wait_for(lambda: read_marker(output_dir), timeout=60)
    signal_to_saved = time.monotonic() - signalled
    code, log = finish(agent, output_dir)
    stopped_at = marker["step"]
    # at the next step (~step 13), not at the epoch's evaluation (step 32), where the ranks also compare notes
    assert marker["phase"] == "train" and stopped_at < 32, marker
    assert f"preempted by {'SIGTERM' if target == 'agent' else 'SIGUSR1'} at step {stopped_at}" in log, log[-3000:]
    assert stopped_at in checkpoint_steps(output_dir) and stopped_at > 5
    assert "Traceback" not in log.split("preempted by")[0], log[-3000:]  # the workers stopped cleanly
    if target == "agent":  # torchrun itself exits 1 after its workers (torch's SignalException)
        assert code == 1, log[-3000:]
        assert log.count("resumed from") == 0, "the group was restarted in place"
        code, log = finish(torchrun(output_dir, *command), output_dir)
    else:  # restarted in place by its agent: finished in the same launch
        assert log.count("resumed from") == 1, log[-3000:]
    assert code == 0, log[-3000:]
    assert f"resumed from {output_dir / 'checkpoints' / f'step_{stopped_at}'}: step {stopped_at}," in log
    assert read_marker(output_dir) is None, "a finished run must not look preempted"
    assert_same_weights(standard_reference, output_dir)
    print(
        f"\n{target}: signal -> checkpoint of step {stopped_at} complete in {signal_to_saved:.2f} s "
        f"(save itself {marker['save_s']} s); steps redone after resume: 0",
        file=sys.stderr,
    )


@pytest.mark.multiprocess
def test_a_stopped_job_resumes_at_another_world_size(tmp_path):
    """The working way to change the number of processes (torch's elastic membership change fails, see
    docs/launching.md): stop the job (SIGTERM: it checkpoints the step reached), relaunch at the new size with
    --resume-from-checkpoint latest. 2 processes x 4 samples, then 1 x 8: the same global batch, so the weights end
    as an uninterrupted run's (within float rounding: the gradient is summed in another order)."""
    common = [
        "--batch-size",
        "4",
        "--epochs",
        "2",
        "--train-size",
        "256",
        "--dropout",
        "0",
        "--checkpointing-steps",
        "100",
    ]
    reference = tmp_path / "reference"  # 1 process x 8, in this process: the same global batch as 2 x 4
    check_ok(run_script(PROBE, "--output-dir", reference, *common, "--batch-size", "8"))
    output_dir = tmp_path / "resized"
    agent = torchrun(output_dir, *common, "--step-ms", "40", "--resume-from-checkpoint", "latest")
    wait_for(lambda: "train:" in output_dir.with_suffix(".log").read_text())
    time.sleep(1.0)
    agent.send_signal(signal.SIGTERM)
    marker = wait_for(lambda: read_marker(output_dir), timeout=60)
    finish(agent, output_dir)
    # the same command on 1 process x 8 (in this process: what crosses processes is the checkpoint)
    resume = ["--batch-size", "8", "--resume-from-checkpoint", "latest"]
    output = check_ok(run_script(PROBE, "--output-dir", output_dir, *common, *resume))
    assert f"resumed from {output_dir / 'checkpoints' / ('step_' + str(marker['step']))}" in output, output[-3000:]
    a, b = weights(reference), weights(output_dir)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)


@pytest.mark.multiprocess
def test_a_hung_dataloader_worker_is_diagnosed_and_the_restart_resumes_to_identical_weights(
    standard_reference, tmp_path
):
    # one rank's loader blocks for good on one sample: without the watchdog both ranks would wait for the collective
    # timeout (10 minutes by default); with it, each says where it waits and exits 4, torchrun restarts the group
    output_dir = tmp_path / "hung_worker"
    args = ["--workers", "1", "--hang-at-sample", "150", "--hang-timeout-s", "5"]
    started = time.monotonic()
    agent = torchrun(
        output_dir, *COMMON, "--step-ms", "20", *args, "--resume-from-checkpoint", "latest", max_restarts=1
    )
    code, log = finish(agent, output_dir)
    assert code == 0, log[-3000:]
    assert (output_dir / "hung_once").is_file(), "the sample never hung"
    hung = [line for line in log.splitlines() if "made no progress for" in line]
    assert any("it waits for its DataLoader workers (pid" in line for line in hung), log[-3000:]
    assert all(line.startswith("error: rank ") and "Exiting with status 4" in line for line in hung), hung
    reports = sorted(path.name for path in (output_dir / "hangs").iterdir())
    assert reports and set(reports) <= {"rank_0.txt", "rank_1.txt"}, reports
    assert "resumed from" in log or "resume" not in log
    assert_same_weights(standard_reference, output_dir)
    print(f"\nhung worker -> diagnosed, restarted and finished in {time.monotonic() - started:.0f} s", file=sys.stderr)


@pytest.mark.multiprocess
def test_a_stopped_rank_is_diagnosed_by_its_peer_and_the_restart_resumes_to_identical_weights(
    standard_reference, tmp_path
):
    # SIGSTOP: a rank that stops making progress without a word (a stuck driver, a swapped-out node)
    output_dir = tmp_path / "stopped_rank"
    args = ["--hang-timeout-s", "5", "--resume-from-checkpoint", "latest"]
    agent = torchrun(output_dir, *COMMON, "--step-ms", "20", *args, max_restarts=1)
    wait_for(lambda: 10 in checkpoint_steps(output_dir))
    victim = next(pid for pid in workers(agent) if rank_of(pid) == 1)
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "rank 0 made no progress" in log_file.read_text(), timeout=60, what="rank 0's watchdog line")
    diagnosed_s = time.monotonic() - stopped
    os.kill(victim, signal.SIGCONT)  # torch's agent stops it (a stopped process cannot obey its SIGTERM)
    code, log = finish(agent, output_dir)
    assert code == 0, log[-3000:]
    line = next(line for line in log.splitlines() if "rank 0 made no progress" in line)
    assert "another rank" in line and "Exiting with status 4" in line, line
    assert 5 <= diagnosed_s < 30, diagnosed_s
    assert "resumed from" in log
    assert_same_weights(standard_reference, output_dir)
    print(f"\nSIGSTOP of rank 1 -> rank 0's diagnosis after {diagnosed_s:.1f} s", file=sys.stderr)


@pytest.mark.multiprocess
def test_a_process_forked_from_ours_ends_on_sigterm_and_leaves_no_marker(tmp_path):
    # pool workers forked during preprocessing inherit the handler; their pool ends them with SIGTERM
    import multiprocessing
    import time

    from ddp_accel import StopSignals
    from ddp_accel.stopping import PREEMPTED_MARKER

    with StopSignals() as signals:
        signals.set_output_dir(tmp_path)
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
        child.start()
        time.sleep(0.2)
        os.kill(child.pid, signal.SIGTERM)
        child.join(10)
        assert child.exitcode == -signal.SIGTERM and signals.received is None
    assert not (tmp_path / PREEMPTED_MARKER).exists()


@pytest.mark.multiprocess
def test_a_killed_rank_costs_no_training_its_survivor_saves_the_step_it_reached(standard_reference, tmp_path):
    # no periodic checkpoint to fall back on: the survivor (rank 0, a full DDP replica) saves the step it reached
    # when its collective fails, for every rank; the restarted group resumes there and ends bitwise as uninterrupted
    output_dir = tmp_path / "rescued"
    command = [*COMMON, "--step-ms", "40", "--checkpointing-steps", "1000", "--resume-from-checkpoint", "latest"]
    agent = torchrun(output_dir, *command, max_restarts=1)
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "train:" in log_file.read_text(), alive=agent, what="the training")
    time.sleep(1.5)  # some steps in
    os.kill(next(pid for pid in wait_for(lambda: workers(agent)) if rank_of(pid) == 1), signal.SIGKILL)
    code, log = finish(agent, output_dir)
    assert code == 0, log[-3000:]
    saved = [line for line in log.splitlines() if "saved the step it reached for the restart" in line]
    assert len(saved) == 1, log[-3000:]
    step = int(saved[0].rsplit("step_", 1)[1])
    assert resumed_steps(log) == [step] and step > 0, log[-3000:]  # not from the start: nothing redone
    assert "a survivor saves the step it reached" in log  # the banner said so
    assert_same_weights(standard_reference, output_dir)


@pytest.mark.multiprocess
def test_a_killed_launcher_ends_its_workers_with_a_checkpoint_the_same_command_resumes(standard_reference, tmp_path):
    # torch starts each worker in a session of its own: a SIGKILL of torchrun alone would leave both ranks training
    # on, holding the output dir; they notice they lost their parent, agree on a step, save it and end
    output_dir = tmp_path / "orphaned"
    command = [*COMMON, "--step-ms", "40", "--resume-from-checkpoint", "latest"]
    agent = torchrun(output_dir, *command)
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "train:" in log_file.read_text(), alive=agent, what="the training")
    time.sleep(1.0)  # some steps in
    ranks = wait_for(lambda: workers(agent) if len(workers(agent)) == 2 else None)
    agent.kill()
    agent.wait()
    killed = time.monotonic()

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    wait_for(lambda: not any(running(pid) for pid in ranks), timeout=60, what="the workers to end")
    ended_s = time.monotonic() - killed
    log = log_file.read_text()
    marker = read_marker(output_dir)
    assert marker is not None and marker["phase"] == "train", log[-3000:]
    assert "its launcher (pid" in log, log[-3000:]
    assert marker["step"] in checkpoint_steps(output_dir)
    code, log = finish(torchrun(output_dir, *command), output_dir)
    assert code == 0, log[-3000:]
    assert resumed_steps(log) == [marker["step"]], log[-3000:]
    assert_same_weights(standard_reference, output_dir)
    print(f"\nlauncher killed -> workers ended with step_{marker['step']} saved in {ended_s:.1f} s", file=sys.stderr)


@pytest.mark.multiprocess
def test_a_rank_killed_right_after_an_evaluation_is_saved_by_its_survivor_and_resumed_bitwise(
    standard_reference, tmp_path
):
    # between the step's agreement and the failure, an evaluation and a new epoch's loader ran: the survivor's
    # save of the step resumes as a checkpoint of the step would
    output_dir = tmp_path / "after_eval"
    command = [*COMMON, "--step-ms", "300", "--checkpointing-steps", "1000", "--resume-from-checkpoint", "latest"]
    agent = torchrun(output_dir, *command, max_restarts=1)
    log_file = output_dir.with_suffix(".log")
    wait_for(lambda: "step 32: eval_loss" in log_file.read_text(), alive=agent, what="the first evaluation")
    os.kill(next(pid for pid in workers(agent) if rank_of(pid) == 1), signal.SIGKILL)  # in step 33's forward
    code, log = finish(agent, output_dir)
    assert code == 0, log[-3000:]
    assert resumed_steps(log) == [32], log[-3000:]
    assert_same_weights(standard_reference, output_dir)


@pytest.fixture(scope="module")
def batchnorm_reference(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("batchnorm") / "reference"
    code, log = finish(torchrun(output_dir, *COMMON, "--batchnorm"), output_dir)
    assert code == 0, log[-3000:]
    return output_dir


@pytest.mark.multiprocess
@pytest.mark.parametrize("lost", [0, 1])
def test_a_batchnorm_model_survives_a_lost_rank_bitwise_saved_by_its_survivor(batchnorm_reference, tmp_path, lost):
    # each rank updates its BatchNorm statistics with its own batch and a checkpoint keeps rank 0's, which travel in
    # each step's agreement: the survivor of either rank saves the step it reached, rank 0's statistics as the step
    # left them (the next step's forward had changed them), and the run ends bitwise, buffers included
    output_dir = tmp_path / f"rank{lost}_lost"
    command = [*COMMON, "--batchnorm", "--step-ms", "40", "--resume-from-checkpoint", "latest"]
    agent = torchrun(output_dir, *command, max_restarts=1)
    wait_for(lambda: 10 in checkpoint_steps(output_dir), alive=agent, what="the checkpoint of step 10")
    time.sleep(0.1)  # between two periodic checkpoints
    os.kill(next(pid for pid in workers(agent) if rank_of(pid) == lost), signal.SIGKILL)
    code, log = finish(agent, output_dir)
    assert code == 0, log[-3000:]
    assert "a survivor saves the step it reached" in log, log[-3000:]  # the banner
    saved = [line for line in log.splitlines() if f"process {1 - lost} saved the step it reached for the" in line]
    refused = "process 1: the restart resumes from the last checkpoint (the models' buffers at step"
    if lost == 0 and refused in log:  # (rank 0 killed inside a step's agreement, after that step's forward: its
        # statistics of that step, which the agreement would have brought, died with it; the last checkpoint's)
        at = int(log.split(refused, 1)[1].split()[0])
        resumed = resumed_steps(log)  # the newest periodic checkpoint before it (one every 5 steps)
        assert not saved and len(resumed) == 1 and at - 5 <= resumed[0] < at and resumed[0] % 5 == 0, log[-3000:]
    else:
        assert len(saved) == 1 and resumed_steps(log) == [int(saved[0].rsplit("step_", 1)[1])], log[-3000:]
    assert_same_weights(batchnorm_reference, output_dir)
