"""Preemption as clusters deliver it: a signal to every process of the job (launcher, ranks, DataLoader workers) at
any moment of its life. One chained run is signalled again and again, at moments drawn from a seeded random
generator, until every phase was hit (before training, training, an evaluation, the final evaluations, the commit of
the final artifacts); one of its runs is under accelerate launch with persistent DataLoader workers, one gets SIGUSR1
and a second one during the save; each stop leaves `preempted.json` with its phase (or a complete run), no process
of the tree outlives the stop by 10 s, and the chain ends bitwise equal to an uninterrupted run. Then one moment for
one process."""

import json
import os
import random
import re
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
    assert_nothing_left,
    check_ok,
    free_port,
    kill_tree,
    metrics_of,
    process_tree,
    run_script,
    wait_for,
    weights,
)

pytestmark = pytest.mark.system

PROBE = str(ROOT / "tests" / "probe.py")
# 2 ranks x batch 4 over 96 samples: 12 steps an epoch, 8 epochs; a slow evaluation every 8 steps and at epoch ends
# (3 batches of 250 ms per rank), a slow test set at the end; 2 DataLoader workers per rank (training, evaluation)
ARGS = ["--batch-size", "4", "--train-size", "96", "--dropout", "0.3", "--workers", "2"]
ARGS += ["--step-ms", "60", "--eval-steps", "8", "--test-size", "24", "--checkpointing-steps", "10"]
SLOW_EVAL_MS = 250  # the chain's evaluations are slow enough to be hit; the single moments need no slow phase
LAST_STEP = 96
PHASES = ("startup", "train", "eval", "final", "commit")
# torchrun passes SIGUSR1 on only when told to (slurm/train.sbatch does the same)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ENV["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def start(
    output_dir: Path, launcher: str = "torchrun", nproc: int = 2, epochs: int = 8, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    """The probe under `launcher`, resuming from its latest checkpoint (the chain: 8 epochs with slow evaluations;
    single moments: 2 epochs)."""
    log = open(output_dir.with_suffix(".log"), "a")
    args = [PROBE, *probe_args(output_dir, epochs, extra)]
    if launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), *args]
    elif launcher == "accelerate":
        command = [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / "multi_gpu.yaml"),
        ]
        command += ["--num_processes", str(nproc), "--main_process_port", str(free_port()), *args]
    else:
        command = [sys.executable, *args]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV, start_new_session=True)


def probe_args(output_dir: Path, epochs: int, extra: tuple[str, ...] = ()) -> list[str]:
    extra = ("--eval-ms", str(SLOW_EVAL_MS if epochs == 8 else 0), *extra)
    return [
        "--output-dir",
        str(output_dir),
        *ARGS,
        *extra,
        "--epochs",
        str(epochs),
        "--resume-from-checkpoint",
        "latest",
    ]


def signal_every_process(agent: subprocess.Popen, signum: int) -> list[int]:
    """What SLURM does to a job step: the signal to every process of it at once."""
    pids = process_tree(agent.pid)
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return pids


def alive(pids: list[int]) -> list[int]:
    living = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            living.append(pid)
    return living


def assert_all_gone(pids: list[int], by: float) -> None:
    """No process of the tree is alive at `by` (10 s after the signal)."""
    wait_for(lambda: not alive(pids), timeout=max(0.1, by - time.monotonic()), what="every process to end")


def marker(output_dir: Path) -> dict | None:
    path = output_dir / "preempted.json"
    return json.loads(path.read_text()) if path.is_file() else None


def assert_only_the_launchers_traceback(text: str) -> None:
    """torchrun's agent, signalled itself, exits with a SignalException traceback (torch's behaviour); any other
    traceback is a process that did not stop in order."""
    for block in text.split("Traceback (most recent call last):")[1:]:
        assert "SignalException" in "\n".join(block.splitlines()[:80]), block[:3000]


def log_of(output_dir: Path) -> str:
    return output_dir.with_suffix(".log").read_text()


def stop_at(output_dir: Path, agent: subprocess.Popen, phase: str, rng: random.Random, signum: int) -> float:
    """Signal the whole tree at a moment of `phase`, drawn at random within it; returns when it was sent."""
    log_start = len(log_of(output_dir))

    def new_log() -> str:
        return log_of(output_dir)[log_start:]

    if phase == "startup":  # the ranks' interpreter start, imports, data and model: a few seconds
        wait_for(lambda: len(process_tree(agent.pid)) >= 3, timeout=60, interval=0.01, alive=agent, what="the ranks")
        time.sleep(rng.uniform(0.0, 1.5))
    elif phase in ("train", "eval"):  # steps of 60 ms; an evaluation of ~0.75 s every 8 steps and at epoch ends
        # after the end of an evaluation come at least 4 training steps (~0.25 s), at most 8, then the next one
        wait_for(lambda: re.search(r"step \d+: eval", new_log()), timeout=120, alive=agent, what="an evaluation")
        time.sleep(rng.uniform(0.03, 0.2) if phase == "train" else rng.uniform(0.6, 1.0))
    elif phase == "final":  # the test set (3 slow batches per rank) after the last step's evaluation
        wait_for(lambda: f"step {LAST_STEP}: eval" in new_log(), timeout=180, alive=agent, what="the last evaluation")
        time.sleep(rng.uniform(0.05, 0.4))
    elif phase == "commit":  # model, curves (matplotlib) and metrics, after the test set's line
        wait_for(lambda: "test: " in new_log(), timeout=180, alive=agent, what="the test evaluation")
        time.sleep(rng.uniform(0.0, 0.05))
    sent = time.monotonic()
    signal_every_process(agent, signum)
    return sent


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, made once per (launcher, epochs): every 2-process launcher gives bitwise the same weights
    (test_launchers.py), so torchrun's stands for accelerate launch's."""
    made: dict[tuple[str, int], Path] = {}

    def reference(launcher: str = "torchrun", epochs: int = 8) -> Path:
        key = ("python" if launcher == "python" else "torchrun", epochs)
        if key not in made:
            output_dir = tmp_path_factory.mktemp("preemption") / f"reference_{key[0]}_{epochs}"
            if key[0] == "python":  # one process: in this one
                check_ok(run_script(PROBE, *probe_args(output_dir, epochs)))
            else:
                assert start(output_dir, key[0], epochs=epochs).wait(timeout=300) == 0, log_of(output_dir)[-3000:]
            made[key] = output_dir
        return made[key]

    return reference


def test_signals_to_every_process_at_any_moment_lose_nothing(tmp_path, references):
    rng = random.Random(20261126)
    output_dir, stops, hit = tmp_path / "chained", [], set()
    # before training, training and evaluation at least once each, in random order, with 5 more drawn from them;
    # then the final evaluations and the commit (after which the run is complete): 10 signals
    plan = rng.sample(["startup", "train", "eval"] + [rng.choice(["startup", "train", "eval"]) for _ in range(5)], 8)
    plan += ["final", "commit"]
    # the first run aimed at an evaluation runs under accelerate launch with persistent DataLoader workers (the
    # others start theirs each epoch); the first aimed at training gets SLURM's time-limit warning (SIGUSR1) to
    # every process, and again while the processes save
    under_accelerate, signalled_twice = plan.index("eval"), plan.index("train")
    last_saved = None  # the marker of the newest stop that saved a checkpoint: where the next run must resume
    for number, phase in enumerate(plan, 1):
        (output_dir / "preempted.json").unlink(missing_ok=True)  # as slurm/train.sbatch does before each run
        accelerate, twice = number - 1 == under_accelerate, number - 1 == signalled_twice
        log_start = len(log_of(output_dir)) if output_dir.with_suffix(".log").is_file() else 0
        signum = signal.SIGUSR1 if twice else signal.SIGTERM
        agent = start(output_dir, "accelerate", extra=("--persistent-workers",)) if accelerate else start(output_dir)
        pids_before = process_tree(agent.pid)
        sent = stop_at(output_dir, agent, phase, rng, signum)
        if twice:  # again, while the processes save
            wait_for(lambda: any(output_dir.glob("checkpoints/.tmp_step_*")) or marker(output_dir), interval=0.002)
            signal_every_process(agent, signum)
        pids = list(set(pids_before) | set(process_tree(agent.pid)))
        try:
            code = agent.wait(timeout=60)
            assert_nothing_left(agent.pid, agent.args)  # a stopped command returns with nothing of it left
        finally:
            kill_tree(agent)
        assert_all_gone(pids, by=sent + 10)
        found = marker(output_dir)
        assert_only_the_launchers_traceback(log_of(output_dir))
        if last_saved is not None and (found is None or found["phase"] != "startup"):  # it trained: it resumed
            resumed = f"resumed from {last_saved['checkpoint']}: step {last_saved['step']},"
            this_run = log_of(output_dir)[log_start:]
            assert resumed in this_run, (number, resumed, this_run[-3000:])
        if found is None:  # complete: only a signal in the commit, which finishes its work
            assert phase == "commit" and (output_dir / "metrics.json").is_file(), log_of(output_dir)[-3000:]
            stops.append((number, phase, "complete", code))
            hit.add("commit")
            break
        assert found["signal"] == signal.Signals(signum).name, found
        assert found["phase"] in PHASES, found
        if accelerate or twice:
            assert found["phase"] in ("train", "eval"), (found, "under accelerate" if accelerate else "SIGUSR1 twice")
        if found["phase"] != "startup":
            assert Path(found["checkpoint"]).joinpath("training_state.json").is_file(), found
            last_saved = found
        hit.add(found["phase"])
        how = "accelerate" if accelerate else "SIGUSR1 twice" if twice else "torchrun"
        stops.append((number, phase, found["phase"], found.get("step"), found.get("save_s"), code, how))
    print("\n" + "\n".join(f"signal {s[0]}: aimed at {s[1]}, hit {s[2:]}" for s in stops), file=sys.stderr)
    assert len(stops) >= 10, stops
    assert hit >= set(PHASES), f"phases hit: {hit}"
    text = log_of(output_dir)
    for line in text.splitlines():  # the workers never turned an orderly stop into a crash
        assert "DataLoader worker" not in line and "exited unexpectedly" not in line, line
    assert marker(output_dir) is None
    reference_weights, final = weights(references()), weights(output_dir)
    assert all(torch.equal(reference_weights[key], final[key]) for key in reference_weights)
    metrics = metrics_of(output_dir)
    assert metrics["steps"] == LAST_STEP and metrics["test_samples"] == 24


def test_one_process_stopped_mid_training_resumes_bitwise(tmp_path, references):
    # (accelerate launch and SIGUSR1 twice have their moments in the chain above)
    output_dir = tmp_path / "one_process"
    agent = start(output_dir, "python", epochs=2)
    wait_for(
        lambda: (output_dir / "checkpoints" / "step_10" / "training_state.json").is_file(),
        alive=agent,
        what="the checkpoint of step 10",
    )
    time.sleep(0.2)
    pids = process_tree(agent.pid)
    signal_every_process(agent, signal.SIGTERM)
    try:
        agent.wait(timeout=60)
        assert_nothing_left(agent.pid, agent.args)
    finally:
        kill_tree(agent)
    assert_all_gone(pids, by=time.monotonic() + 10)
    found = marker(output_dir)
    assert found is not None and found["signal"] == "SIGTERM", log_of(output_dir)[-3000:]
    assert found["phase"] in ("train", "eval"), found
    assert_only_the_launchers_traceback(log_of(output_dir))
    again = check_ok(run_script(PROBE, *probe_args(output_dir, 2)))  # in this process
    assert f"resumed from {found['checkpoint']}: step {found['step']}," in again
    assert marker(output_dir) is None
    expected, final = weights(references("python", epochs=2)), weights(output_dir)
    assert all(torch.equal(expected[key], final[key]) for key in expected)


def importing_torch(agent: subprocess.Popen) -> int:
    """The agent's ranks that have begun to import torch (its shared library mapped)."""
    count = 0
    for pid in process_tree(agent.pid)[1:]:
        try:
            count += "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
    return count


def test_a_signal_during_the_imports_on_a_loaded_machine_leaves_its_marker_before_the_launchers_grace(tmp_path):
    # a loaded node (a CPU hog beside the job) where the imports outlast the launcher's grace (here 2 s; torchrun's
    # default 30 s): with the signals blocked until run_main, torchrun killed the ranks mid-import and no marker
    # was left; now each rank writes it and exits at once
    hog = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        output_dir = tmp_path / "run"
        env = {**ENV, "TORCHELASTIC_SHUTDOWN_TIMEOUT": "2", "PET_SHUTDOWN_TIMEOUT": "2"}
        command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), PROBE]
        command += ["--output-dir", str(output_dir), "--workers", "2"]
        log = open(tmp_path / "run.log", "w")
        agent = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        # the ranks in their imports: torch's libraries mapped (their interpreter's own start is before any line of
        # the script can act; a signal there is the default action's)
        wait_for(lambda: importing_torch(agent) >= 2, timeout=120, interval=0.01, alive=agent, what="the imports")
        pids = signal_every_process(agent, signal.SIGTERM)
        assert_all_gone(pids, time.monotonic() + 10)
    finally:
        for process in hog:
            process.kill()
    facts = marker(output_dir)
    assert facts is not None and facts["phase"] == "startup" and facts["moment"] == "imports", facts
    text = (tmp_path / "run.log").read_text()
    assert "preempted by SIGTERM before training started" in text, text[-3000:]
    assert_only_the_launchers_traceback(text)
