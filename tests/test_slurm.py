"""slurm/train.sbatch on a real SLURM (two "nodes" on this host): a 2-node job, the time-limit warning
(USR1 -> checkpoint -> requeue -> resume) and a preemption (SIGTERM to the job step), each ending with the
weights of an uninterrupted run."""

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import ROOT, wait_for_checkpoint, weights
from slurm_cluster import LocalSlurm, missing_binaries

pytestmark = pytest.mark.skipif(
    bool(missing_binaries()),
    reason=(
        f"SLURM is not installed ({', '.join(missing_binaries())} missing): "
        "apt-get install slurmctld slurmd slurm-client munge"
    ),
)

# 256 samples, 2 nodes x 1 process x batch 4: 32 steps an epoch; a checkpoint every 5 steps; dropout on
PROBE_ARGS = "--batch-size 4 --epochs 3 --train-size 256 --dropout 0.3 --checkpointing-steps 5 --step-ms 40"
# the test cluster: CPU nodes of 1 core; everything else is the shipped script's
SBATCH_OPTIONS = ["--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def submit(
    slurm: LocalSlurm,
    output_dir: Path,
    extra: str = "",
    options=(),
    cwd: Path = ROOT,
    config: str | None = None,
    env: dict | None = None,
) -> tuple[str, Path]:
    log = output_dir.parent / f"{output_dir.name}.slurm.log"
    env = {
        **(env or {}),
        **({"CONFIG": config} if config else {}),
        "SCRIPT": "tests/probe.py",
        "SCRIPT_ARGS": f"{PROBE_ARGS} {extra}".strip(),
        "OUTPUT_DIR": str(output_dir),
        "PROCESSES_PER_NODE": "1",
        "VENV": str(Path(sys.executable).parent.parent),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    job = slurm.sbatch(ROOT / "slurm" / "train.sbatch", *SBATCH_OPTIONS, *options, f"--output={log}", env=env, cwd=cwd)
    return job, log


def start_requeued_run(slurm: LocalSlurm, job: str, log: Path, restart: int) -> None:
    """Wait for the job's requeue number `restart` and start that run at once (SLURM holds it ~120 s otherwise)."""
    deadline = time.monotonic() + 120
    while int(slurm.job(job).get("Restarts", 0)) < restart:  # the job state passes through transient ones
        assert time.monotonic() < deadline, f"job {job} was not requeued: {slurm.job(job)}\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    if slurm.wait_state(job, "PENDING", "RUNNING")["JobState"] == "PENDING":
        # starting it before the nodes have cleaned up the previous run fails it ("Job credential revoked"), so
        # wait for idle nodes and a little more
        slurm.wait_idle()
        time.sleep(3)
        slurm.scontrol("update", f"JobId={job}", "StartTime=now", check=False)


def finish(slurm: LocalSlurm, job: str, log: Path, requeues: int = 0) -> str:
    """Wait for the job to end, starting each requeued run at once."""
    for restart in range(1, requeues + 1):
        start_requeued_run(slurm, job, log, restart)
    state = slurm.wait_state(job, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    text = log.read_text()
    assert state["JobState"] == "COMPLETED", f"{state}\n{text[-4000:]}"
    return text


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> tuple[Path, str]:
    output_dir = tmp_path_factory.mktemp("slurm_runs") / "uninterrupted"
    job, log = submit(slurm, output_dir)
    return output_dir, finish(slurm, job, log)


@pytest.mark.system
def test_two_node_job_runs_one_launcher_per_node_with_the_right_ranks(uninterrupted):
    output_dir, log = uninterrupted
    assert re.search(r"world_size\s+2\b", log) and re.search(r"num_nodes\s+2\b", log), log[-3000:]
    # (global rank, machine rank, node): static rendezvous with 1 process per node gives global rank = machine
    # rank, and each node's machine rank is its own $SLURM_NODEID (n1 -> 0, n2 -> 1), not the batch shell's
    ranks = sorted(re.findall(r"probe rank (\d) machine_rank (\d) node (n\d)", log))
    assert ranks == [("0", "0", "n1"), ("1", "1", "n2")], log[-3000:]
    assert (output_dir / "model.safetensors").is_file() and not (output_dir / "preempted.json").exists()


@pytest.mark.parametrize("how", ["time_limit_warning", "step_sigterm", "preempted_by_urgent_job"])
@pytest.mark.system
def test_signal_checkpoint_requeue_resume_loses_nothing(slurm, uninterrupted, tmp_path, how):
    """time_limit_warning: USR1 to the batch shell (what --signal=B:USR1@T sends before the limit); it tells the
    job step to save. step_sigterm: SIGTERM straight to the job step's processes. preempted_by_urgent_job: a real
    preemption (PreemptMode=REQUEUE): SLURM signals the job, which saves; SLURM requeues it. Every time the
    processes save the step reached and the rerun resumes from exactly that step."""
    output_dir = tmp_path / how
    job, log = submit(slurm, output_dir)
    wait_for_checkpoint(output_dir, 5)
    time.sleep(0.4)  # between scheduled checkpoints
    signalled, signalled_at = time.monotonic(), time.time()
    if how == "preempted_by_urgent_job":  # a job of a higher-priority partition takes both nodes
        slurm.sbatch(None, "--partition=urgent", "--nodes=2", "--wrap=sleep 1", f"--output={tmp_path}/urgent.log")
    else:
        target = ["--signal=USR1", "--batch", job] if how == "time_limit_warning" else ["--signal=TERM", f"{job}.0"]
        subprocess.run(["scancel", *target], env=slurm.env, check=True)
    while not (output_dir / "preempted.json").is_file() and slurm.job(job).get("JobState") == "RUNNING":
        time.sleep(0.02)
    signal_to_saved = time.monotonic() - signalled
    text = finish(slurm, job, log, requeues=1)
    stopped = int(re.search(r"preempted by \S+ at step (\d+)", text).group(1))
    assert stopped > 5 and f"step_{stopped}" in text
    assert "run 2:" in text and slurm.job(job)["Restarts"] == "1", text[-3000:]
    resumed = re.search(r"resumed from \S+: step (\d+),", text)
    assert resumed and int(resumed.group(1)) == stopped, text[-3000:]  # no step redone, none skipped
    assert not (output_dir / "preempted.json").exists()
    reference, final = weights(uninterrupted[0]), weights(output_dir)
    assert all(torch.equal(reference[key], final[key]) for key in reference), (
        "weights differ from the uninterrupted run"
    )
    rerun = re.search(r"(\d\d):(\d\d):(\d\d) job \d+ run 2:", text)
    local = time.localtime(signalled_at)  # the script's `date +%T` is local time, to the second
    rerun_s = (
        int(rerun.group(1)) * 3600
        + int(rerun.group(2)) * 60
        + int(rerun.group(3))
        - (local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec)
    ) % 86400
    print(
        f"\n{how}: stopped at step {stopped}, checkpoint complete {signal_to_saved:.1f} s after the signal; "
        f"the requeued run started {rerun_s:.0f} s after the signal (the test starts it once the nodes are idle)",
        file=sys.stderr,
    )


@pytest.mark.system
def test_an_fsdp_config_shards_across_the_nodes_and_a_signalled_step_resumes_to_the_ddp_run_s_weights(
    slurm, uninterrupted, tmp_path
):
    # CONFIG=accelerate_configs/fsdp.yaml: each node's accelerate launch takes it (its process counts are the job's);
    # fp32, where 2 ranks' FSDP steps are bitwise DDP's; the checkpoints written in the background
    output_dir = tmp_path / "fsdp"
    extra = "--mixed-precision no --async-checkpoint"
    job, log = submit(slurm, output_dir, extra=extra, config="accelerate_configs/fsdp.yaml")
    wait_for_checkpoint(output_dir, 5)
    time.sleep(0.4)
    subprocess.run(["scancel", "--signal=TERM", f"{job}.0"], env=slurm.env, check=True)
    text = finish(slurm, job, log, requeues=1)
    assert re.search(r"distributed_type\s+FSDP", text) and "89 on rank 0, 89 on rank 1" in text, text[-3000:]
    stopped = int(re.search(r"preempted by \S+ at step (\d+)", text).group(1))
    resumed = re.search(r"resumed from \S+: step (\d+),", text)
    assert resumed and int(resumed.group(1)) == stopped, text[-3000:]
    assert (output_dir / "checkpoints" / f"step_{stopped}" / "pytorch_model_fsdp_0").is_dir()
    reference, final = weights(uninterrupted[0]), weights(output_dir)
    assert all(torch.equal(reference[key], final[key]) for key in reference), "weights differ from the DDP run"


@pytest.mark.system
def test_an_array_job_keys_each_task_on_its_own_and_each_resumes_its_own_run(slurm, uninterrupted, tmp_path):
    """Two tasks of one array job, each on one node with 2 processes (the uninterrupted 2-node job's global batch):
    an explicit OUTPUT_DIR gets a folder per task, both are preempted (the time-limit warning to each batch shell),
    each requeues itself by its own id (not the whole array), and each resumes its own run, bitwise."""
    output_dir = tmp_path / "array"
    log = tmp_path / "array-%a.slurm.log"
    env = {
        "SCRIPT": "tests/probe.py",
        "SCRIPT_ARGS": PROBE_ARGS,
        "OUTPUT_DIR": str(output_dir),
        "PROCESSES_PER_NODE": "2",
        "VENV": str(Path(sys.executable).parent.parent),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    options = ["--array=0-1", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={log}"]
    array = slurm.sbatch(ROOT / "slurm" / "train.sbatch", *options, env=env, cwd=ROOT)
    tasks = [f"{array}_{index}" for index in (0, 1)]
    folders = [output_dir / f"task_{index}" for index in (0, 1)]
    for folder in folders:
        wait_for_checkpoint(folder, 5, timeout=180)
    time.sleep(0.3)
    for task in tasks:
        subprocess.run(["scancel", "--signal=USR1", "--batch", task], env=slurm.env, check=True)
    for task in tasks:  # each requeued by its own id
        deadline = time.monotonic() + 120
        while int(slurm.job(task).get("Restarts", 0)) < 1:
            assert time.monotonic() < deadline, f"{task} was not requeued: {slurm.job(task)}"
            time.sleep(0.1)
    slurm.wait_idle()
    time.sleep(3)
    for task in tasks:
        slurm.scontrol("update", f"JobId={task}", "StartTime=now", check=False)
    reference = weights(uninterrupted[0])
    for index, (task, folder) in enumerate(zip(tasks, folders, strict=True)):
        state = slurm.wait_state(task, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
        text = (tmp_path / f"array-{index}.slurm.log").read_text()
        assert state["JobState"] == "COMPLETED", f"{state}\n{text[-4000:]}"
        assert f"requeueing job {task}" in text and f"job {task} run 2:" in text, text[-3000:]
        stopped = int(re.search(r"preempted by \S+ at step (\d+)", text).group(1))
        assert re.search(rf"resumed from {re.escape(str(folder))}/checkpoints/step_{stopped}: step {stopped},", text)
        final = weights(folder)
        assert all(torch.equal(reference[key], final[key]) for key in reference), f"task {index} differs"


@pytest.mark.system
def test_several_tasks_without_a_launcher_stop_with_one_line(slurm, tmp_path):
    """`srun -n 2 python scripts/template.py` would start two lone trainings into one folder."""
    command = ["srun", "-N", "2", "-n", "2", sys.executable, str(ROOT / "scripts" / "template.py")]
    command += ["--output-dir", str(tmp_path / "out")]
    env = {**slurm.env, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors and all("without a launcher" in line for line in errors), output[-3000:]
    assert "Traceback" not in output and not (tmp_path / "out").exists()


@pytest.mark.multiprocess
def test_the_job_script_outside_slurm_stops_with_one_line(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    result = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch")], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "unbound variable" not in result.stderr
    assert result.stderr.count("error: ") == 1 and "submit it with 'sbatch slurm/train.sbatch'" in result.stderr


@pytest.mark.system
def test_a_hung_rank_is_requeued_by_the_job_script_and_resumes_to_the_same_weights(slurm, uninterrupted, tmp_path):
    # one rank's DataLoader worker blocks for good on a sample: its progress watchdog (5 s here) ends the step with
    # a report in OUTPUT_DIR/hangs/, the job script requeues the job, the rerun resumes from the newest checkpoint
    output_dir = tmp_path / "hung"
    job, log = submit(slurm, output_dir, extra="--workers 1 --hang-at-sample 150 --hang-timeout-s 5")
    text = finish(slurm, job, log, requeues=1)
    assert "made no progress for" in text and "a rank hung (hang requeue 1 of 3); requeueing job" in text, text[-3000:]
    assert (output_dir / "hangs" / "requeues").read_text().strip() == "1"
    assert re.search(r"resumed from \S+: step (\d+),", text), text[-3000:]
    reference, final = weights(uninterrupted[0]), weights(output_dir)
    assert all(torch.equal(reference[key], final[key]) for key in reference), "weights differ"


def wait_for_log(log: Path, text: str, slurm: LocalSlurm, job: str, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while text not in (log.read_text() if log.is_file() else ""):
        assert time.monotonic() < deadline, f"{text!r} not in the log: {slurm.job(job)}\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    return log.read_text()


@pytest.mark.system
def test_scancel_ends_the_job_and_keeps_the_checkpoint_without_requeueing(slurm, tmp_path):
    # the script requeued whenever preempted.json existed: a cancelled job started again ~120 s later
    output_dir = tmp_path / "cancelled"
    job, log = submit(slurm, output_dir)
    wait_for_checkpoint(output_dir, 5)
    subprocess.run(["scancel", job], env=slurm.env, check=True)
    text = wait_for_log(log, "not requeueing", slurm, job)
    state = slurm.wait_state(job, "CANCELLED", "PENDING", "COMPLETED", "FAILED")
    assert state["JobState"] == "CANCELLED" and state.get("Restarts") == "0", f"{state}\n{text[-3000:]}"
    assert "requeueing job" not in text and (output_dir / "preempted.json").is_file()


@pytest.mark.system
def test_a_job_that_cannot_be_requeued_fails_with_one_line(slurm, tmp_path):
    # sbatch --no-requeue: `scontrol requeue` is refused; the job ended COMPLETED at step 102 of 640, no model
    output_dir = tmp_path / "no_requeue"
    # submitted from another folder: SCRIPT and CONFIG are still found in the project (they were relative to it)
    job, log = submit(slurm, output_dir, options=["--no-requeue"], cwd=tmp_path)
    wait_for_checkpoint(output_dir, 5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env, check=True)
    state = slurm.wait_state(job, "COMPLETED", "FAILED", "CANCELLED")
    text = log.read_text()
    assert state["JobState"] == "FAILED", f"{state}\n{text[-3000:]}"
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "SLURM refuses to requeue" in errors[0] and "--no-requeue" in errors[0], text[-3000:]


@pytest.mark.system
def test_a_time_limit_that_leaves_no_training_time_is_refused_at_start(slurm, tmp_path):
    # --time=1 with the 180 s signal lead: every run got USR1 within seconds and was requeued, forever
    output_dir = tmp_path / "short"
    job, log = submit(slurm, output_dir, options=["--time=1"])
    state = slurm.wait_state(job, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    text = log.read_text()
    assert state["JobState"] == "FAILED" and state.get("Restarts") == "0", f"{state}\n{text[-3000:]}"
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "raise sbatch --time" in errors[0], text[-3000:]
    assert not (output_dir / "checkpoints").exists()


@pytest.mark.system
def test_a_signal_after_training_finished_ends_the_job_completed(slurm, tmp_path):
    # USR1 after both ranks wrote their model and metrics: the launchers' SignalException made the job FAILED
    output_dir = tmp_path / "late_signal"
    job, log = submit(slurm, output_dir, "--linger-s 10")
    wait_for_log(log, "done: ", slurm, job)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env, check=True)
    state = slurm.wait_state(job, "COMPLETED", "FAILED", "CANCELLED")
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state.get("Restarts") == "0", f"{state}\n{text[-3000:]}"
    assert "training finished before the stop signal" in text and (output_dir / "model.safetensors").is_file()


def batch_shell(job: str) -> psutil.Process:
    """The batch shell of the job's current run: bash running the copy of the script in a node's spool folder."""
    for process in psutil.process_iter(["cmdline"]):
        if any(arg.endswith(f"job{int(job):05d}/slurm_script") for arg in process.info["cmdline"] or ()):
            return process
    raise AssertionError(f"no batch shell of job {job}")


def step_processes(output_dir: Path) -> list[psutil.Process]:
    """The launchers and training processes of the job step (each has the run's --output-dir on its command line)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "--output-dir" in cmdline and str(output_dir) in cmdline and "bash" not in Path(cmdline[0]).name:
            found.append(process)
    return found


def stop_watchdog(shell: psutil.Process, timeout: float = 30) -> tuple[psutil.Process, psutil.Process]:
    """The watchdog the batch shell's trap starts (a subshell) and its sleep."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(psutil.NoSuchProcess):  # scancel and the like come and go
            for child in shell.children():
                sleeps = [grandchild for grandchild in child.children() if grandchild.name() == "sleep"]
                if sleeps:  # (a subshell keeps the script's name)
                    return child, sleeps[0]
        assert time.monotonic() < deadline, "the batch shell started no watchdog after the signal"
        time.sleep(0.05)


@pytest.mark.system
def test_a_step_that_does_not_stop_within_the_grace_is_ended_by_the_job_script(slurm, tmp_path):
    # every process of the step frozen (a launcher stuck on a dead filesystem): GRACE_S + 10 s after the signal the
    # job script ends the step itself (SIGKILL); the job fails with the step's status and keeps its checkpoints
    output_dir = tmp_path / "frozen"
    job, log = submit(slurm, output_dir, extra="--step-ms 100", env={"GRACE_S": "4"})
    wait_for_checkpoint(output_dir, 5)
    frozen = step_processes(output_dir)
    assert len(frozen) == 4, [process.cmdline() for process in frozen]  # 2 launchers, 2 training processes
    for process in frozen:
        process.suspend()
    signalled = time.monotonic()
    try:
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env, check=True)
        state = slurm.wait_state(job, "COMPLETED", "FAILED", "CANCELLED", timeout=90)
    finally:  # a step never ended would stay frozen past the cluster's teardown
        for process in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    ended_after_s, text = time.monotonic() - signalled, log.read_text()
    assert state["JobState"] == "FAILED" and "training ended with status 137" in text, f"{state}\n{text[-3000:]}"
    assert "did not stop within GRACE_S + 10 s; ending the job step" in text and 14 <= ended_after_s < 60, text[-3000:]
    assert (output_dir / "checkpoints" / "step_5" / "training_state.json").is_file()


@pytest.mark.system
def test_the_watchdog_of_a_run_whose_shell_was_ended_leaves_the_requeued_run_alone(slurm, uninterrupted, tmp_path):
    # SLURM may end the batch shell of a stopped run before the shell stops its watchdog; the orphaned watchdog
    # woke GRACE_S + 10 s later and ended the step of the requeued run (JOB.0 again): killed, no checkpoint, FAILED
    output_dir = tmp_path / "orphaned_watchdog"
    job, log = submit(slurm, output_dir, extra="--step-ms 200")
    wait_for_checkpoint(output_dir, 5)
    shell = batch_shell(job)
    for process in step_processes(output_dir):  # the step does not end before the shell is ended (SLURM kills it)
        process.suspend()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env, check=True)
    watchdog, sleep = stop_watchdog(shell)
    shell.kill()  # what SLURM does to the batch shell of a job it ends
    slurm.wait_state(job, "COMPLETED", "FAILED", "CANCELLED")
    assert watchdog.is_running(), "the watchdog did not outlive its batch shell: the case under test is gone"
    slurm.scontrol("requeue", job)
    start_requeued_run(slurm, job, log, restart=1)
    wait_for_log(log, "resumed from", slurm, job)  # the requeued run trains
    sleep.kill()  # the orphaned watchdog wakes now, in the requeued run
    watchdog.wait(timeout=30)
    second_run = finish(slurm, job, log).split(" run 2:", 1)[1]
    assert "did not stop" not in second_run and "CANCELLED" not in second_run, second_run[-3000:]
    reference, final = weights(uninterrupted[0]), weights(output_dir)
    assert all(torch.equal(reference[key], final[key]) for key in reference), "weights differ"
