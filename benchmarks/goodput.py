"""Goodput under failures: the same job run fault-free and while a chaos loop SIGKILLs a random rank every T seconds
(each kill time drawn within T/4 of its slot, seeded; none once the job said `done:`), under `torchrun
--max_restarts`; goodput = fault-free wall time / faulted wall time. `--failure slurm-preemption` instead runs the
job under a local SLURM (two "nodes" on this host, a process each, through slurm/train.sbatch) and preempts the
whole job every T seconds with a job of a higher-priority partition: SLURM signals it, every process saves the
step it reached, SLURM requeues it, and the requeued run resumes. Each checkout first runs the job briefly once,
unmeasured (the files' first reads). `--repeats N` runs N pairs, each fault-free run right before the faulted
runs it is compared with (this machine's pace drifts by ~10% between runs), and reports the median goodput of
the pairs and their range.

    python benchmarks/goodput.py --every-s 60 30 --seed 0
    python benchmarks/goodput.py --jobs resnet20-ddp --every-s 60 --repeats 3   # 3 pairs, the median goodput
    python benchmarks/goodput.py --jobs template-ddp --trees . ../base --every-s 60   # another checkout beside
    python benchmarks/goodput.py --failure slurm-preemption --jobs template-ddp --every-s 60

For each failure: the steps redone (0 when a survivor saved the step reached and the restart resumed there; else
the steps since the checkpoint resumed from, estimated at the fault-free pace), and the time from the failure to:
the line of its save (a survivor's, or the preempted processes'), the requeued run's first line (SLURM: the job's
end, its requeue, the start of the batch script), the restarted process's banner (process start, imports,
rendezvous), its `resumed from` line (checkpoint load); for the last failure also to its first completed step
(the final attempt's metrics.json), beside the fault-free command's own time to its first step. The final weights
are compared with the fault-free run's, bitwise. A markdown table goes to stdout and benchmarks/results/goodput.md, a
plot of goodput against T to benchmarks/results/goodput.png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent

TEMPLATE = ["scripts/template.py", "--epochs", "300", "--batch-size", "32", "--checkpointing-steps", "400"]
RESNET20 = ["scripts/imagenet.py", "--dummy", "-a", "cifar_resnet20", "--image-size", "32", "-b", "32", "-j", "0"]
# the synthetic set's size given (not 100 x -b): the same images when survivors take a larger -b
RESNET20 += ["--dummy-classes", "10", "--dummy-images", "3200", "--epochs", "10", "--checkpointing-steps", "100"]
# a model of >= 100M parameters: VGG-16 (138M), its classifier most of them; small images keep the steps short
VGG16 = ["scripts/imagenet.py", "--dummy", "-a", "vgg16", "--image-size", "32", "-b", "8", "-j", "0"]
VGG16 += ["--dummy-classes", "10", "--epochs", "2", "--checkpointing-steps", "40"]
# 3 processes whose gradient is the global batch's alone (GroupNorm, pieces of 16): the survivors of a kill can go
# on with its share bitwise under `--recovery in-process`
RESNET20_EXACT = [*RESNET20, "--norm", "group", "--exact-micro-batch", "16"]
# VGG-16's 138M parameters on 3 processes in pieces of 4: what a survivor's save of the step costs at some size
VGG16_EXACT = [*VGG16[:-4], "--epochs", "1", "--checkpointing-steps", "1000", "--exact-micro-batch", "4"]
VGG16_EXACT += ["--dummy-images", "960", "--timeout-s", "60"]  # (a bound on the waits gloo may not end at a loss)
FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}  # what accelerate launch gives an FSDP2 config
# name -> (processes, extra environment, the command after torchrun's options)
JOBS: dict[str, tuple[int, dict[str, str], list[str]]] = {
    "template-ddp": (2, {}, TEMPLATE),
    "template-1-process": (1, {}, TEMPLATE),
    "template-fsdp": (2, FSDP, TEMPLATE),
    "resnet20-ddp": (2, {}, RESNET20),
    "resnet20-exact-3": (3, {}, RESNET20_EXACT),
    "vgg16-ddp": (2, {}, VGG16),
    "vgg16-exact-3": (3, {}, VGG16_EXACT),
}
# the step saved for the restart: a survivor's (a rank killed) or every process's (the whole job preempted)
# the step a survivor saved (or found saved already: a periodic checkpoint of that very step), or a stop's
SAVED = re.compile(
    r"(?:saved|writes) the step it reached[^:]*: .*step_(\d+)|preempted by \S+ at step (\d+)"
    r"|the step it reached \((\d+)\) is saved already"
)
DETECTED = re.compile(
    r"(?:saved|writes) the step it reached|lost contact|resumes from the last checkpoint|preempted by"
)
RESUMED = re.compile(r"resumed from \S+: step (\d+)")
FIRST_STEP = re.compile(r"first step done [\d.]+ s after the loss")  # --recover in-process's survivors (or replacement)
REQUEUED_RUN = re.compile(r"job \S+ run (\d+): ")  # slurm/train.sbatch's first line of each run
# the local SLURM's "nodes": 1 core each, 1 process each
SLURM_OPTIONS = ["--gpus-per-node=0", "--cpus-per-task=1"]


@dataclasses.dataclass
class Failure:
    at: float  # time.time() of the kill
    latest_step: int | None  # the newest complete checkpoint then
    latest_at: float | None  # when it was renamed into place
    events: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> seconds after the kill
    resumed_step: int | None = None
    rescued_step: int | None = None


class Log:
    """The job's output file, each new line (or progress-bar update) with the time it was first seen."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, []
        self.run_started = 0  # the index of the line that began the latest run of a SLURM job

    def poll(self) -> None:
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            chunk = file.read()
        complete = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if complete < 0:
            return
        self.offset += complete + 1
        now = time.time()
        for line in re.split(rb"[\r\n]", chunk[: complete + 1]):
            if line.strip():
                self.lines.append((now, line.decode(errors="replace")))
                if REQUEUED_RUN.search(self.lines[-1][1]):
                    self.run_started = len(self.lines) - 1


def committed(output_dir: Path) -> bool:
    """The run's work is over: metrics.json is in place (the script prints its `done:` line after it)."""
    return (output_dir / "metrics.json").is_file()


def failure_time(started: float, mean_s: float | None, slot: int, rng: random.Random) -> float:
    """When the `slot`-th failure comes: within mean_s/4 of slot * mean_s after the start (never without mean_s)."""
    return started + mean_s * (slot + rng.uniform(-0.25, 0.25)) if mean_s else float("inf")


def checkpoints(output_dir: Path) -> list[tuple[int, float]]:
    """(step, when it was renamed into place) of each complete checkpoint."""
    found = []
    for path in (output_dir / "checkpoints").glob("step_*"):
        try:
            found.append((int(path.name.split("_")[1]), path.stat().st_mtime))
        except (ValueError, OSError):
            continue
    return sorted(found)


def workers(agent: subprocess.Popen, script: str) -> list[int]:
    """The agent's worker processes (its children running the script)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == agent.pid and fields[0] != "Z" and script in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


def run_job(
    tree: Path,
    job: str,
    output_dir: Path,
    mean_s: float | None,
    seed: int,
    extra: tuple[str, ...] = (),
    recovery: str = "restart",
) -> dict:
    """One launch of `job` from `tree`, SIGKILLing a random rank every `mean_s` seconds (None: none): under
    `torchrun --max_restarts` (recovery "restart"), or `ddp-accel launch --recover in-process`."""
    processes, env_extra, command = JOBS[job]
    command = [*command, *extra]
    if recovery.startswith("in-process"):
        argv = [str(BIN / "ddp-accel"), "launch", "--recover", "in-process", "--num_processes", str(processes)]
        argv += ["--spares", "1"] if recovery == "in-process-spare" else []
    else:
        argv = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(processes), "--max_restarts", "100"]
        argv += ["--monitor_interval", "0.1"]
    argv += [*command, "--output-dir", str(output_dir), "--resume-from-checkpoint", "latest"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree), **env_extra}
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = output_dir.with_suffix(".log")
    rng, failures = random.Random(seed), []
    with open(log_path, "w") as log_file:
        started = time.time()
        agent = subprocess.Popen(argv, cwd=tree, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        log = Log(log_path)
        slot = 1
        next_kill = failure_time(started, mean_s, slot, rng)
        while agent.poll() is None:
            log.poll()
            if committed(output_dir):  # a kill while the processes exit after the commit is no failure
                next_kill = float("inf")
            if time.time() >= next_kill:
                ranks = [pid for pid in workers(agent, command[0]) if pid not in spares(log)]
                if len(ranks) == processes and not regrouping(log):  # not while the group forms again
                    done = checkpoints(output_dir)
                    os.kill(rng.choice(ranks), signal.SIGKILL)
                    failures.append(Failure(time.time(), *(done[-1] if done else (None, None))))
                    print(f"  {job}: killed a rank {time.time() - started:.0f} s in", file=sys.stderr, flush=True)
                    slot += 1
                    next_kill = failure_time(started, mean_s, slot, rng)
                else:
                    next_kill = time.time() + 0.5  # the group is starting again: a moment later
            time.sleep(0.02)
        log.poll()
        wall_s = time.time() - started
    if agent.returncode != 0:
        raise SystemExit(f"{job}: exit {agent.returncode}; see {log_path}")
    read_events(failures, log)
    return finished(output_dir, started, wall_s, failures)


SPARE_READY = re.compile(r"a spare is ready \(pid (\d+)\)")
SPARE_TAKEN = re.compile(r"a spare \(pid (\d+), its imports done\) takes the place")


def spares(log: Log) -> set[int]:
    """Under --spares: the processes waiting as spares, not ranks (one not yet said ready counts as a process too:
    no kill until it is)."""
    text = "\n".join(line for _, line in log.lines)
    return {int(pid) for pid in SPARE_READY.findall(text)} - {int(pid) for pid in SPARE_TAKEN.findall(text)}


def regrouping(log: Log) -> bool:
    """Under --recovery in-process: a loss whose replacement has not taken its share back yet (the launcher's
    `generation N:` lines; a kill then would be a second failure within one)."""
    said = [line for _, line in log.lines if "ddp-accel launch: generation" in line]
    return bool(said) and "survivors go on" in said[-1]


def read_events(failures: list[Failure], log: Log) -> None:
    """Each failure's figures from the log lines seen after it (and before the next failure)."""
    for index, failure in enumerate(failures):
        until = failures[index + 1].at if index + 1 < len(failures) else float("inf")
        for seen, line in log.lines:
            if not failure.at <= seen < until:
                continue
            after = seen - failure.at
            if DETECTED.search(line):
                failure.events.setdefault("detected", after)
            if (match := SAVED.search(line)) is not None:
                failure.rescued_step = int(next(step for step in match.groups() if step))
            if REQUEUED_RUN.search(line):
                failure.events.setdefault("requeued", after)
            if line.startswith("== "):
                failure.events.setdefault("banner", after)
            if FIRST_STEP.search(line):
                failure.events.setdefault("first_step", after)
            if (match := RESUMED.search(line)) is not None and failure.resumed_step is None:
                failure.resumed_step, failure.events["resumed"] = int(match.group(1)), after


def finished(output_dir: Path, started: float, wall_s: float, failures: list[Failure]) -> dict:
    metrics = json.loads((output_dir / "metrics.json").read_text())
    if failures and metrics["first_step_at"] > failures[-1].at:  # (else the commit came before that failure)
        failures[-1].events.setdefault("first_step", metrics["first_step_at"] - failures[-1].at)
    for failure in failures:  # each failure's timeline, seconds after it
        timeline = ", ".join(
            f"{name} {after:.2f}" for name, after in sorted(failure.events.items(), key=lambda e: e[1])
        )
        print(f"  {failure.at - started:.0f} s in: {timeline}", file=sys.stderr, flush=True)
    return {"wall_s": wall_s, "failures": failures, "metrics": metrics, "started": started}


@contextlib.contextmanager
def local_slurm(root: Path):
    """The tests' SLURM of two "nodes" on this host (tests/slurm_cluster.py), started for this benchmark."""
    sys.path.insert(0, str(ROOT / "tests"))
    from slurm_cluster import LocalSlurm, missing_binaries

    if missing_binaries():
        raise SystemExit(
            f"--failure slurm-preemption: {', '.join(missing_binaries())} not installed "
            "(apt-get install slurmctld slurmd slurm-client munge)"
        )
    with LocalSlurm(root) as slurm:
        yield slurm


def run_slurm_job(
    slurm, tree: Path, job: str, output_dir: Path, mean_s: float | None, seed: int, extra: tuple[str, ...] = ()
) -> dict:
    """One submission of `job` from `tree` to the local SLURM through slurm/train.sbatch (a node per process),
    preempted every `mean_s` seconds (None: never) by a job of a higher-priority partition that takes every node:
    SLURM signals the job (it saves the step reached) and requeues it. SLURM holds a requeued job ~120 s; each
    requeued run is started as soon as the nodes are idle again (the hold is the cluster's policy, not a cost of
    training)."""
    processes, env_extra, command = JOBS[job]
    if env_extra:
        raise SystemExit(f"{job}: --failure slurm-preemption runs DDP jobs (an FSDP job needs its own CONFIG)")
    env = {
        "SCRIPT": command[0],
        "SCRIPT_ARGS": " ".join([*command[1:], *extra]),
        "OUTPUT_DIR": str(output_dir),
        "PROCESSES_PER_NODE": "1",
        "VENV": str(BIN.parent),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(tree),
    }
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = output_dir.with_suffix(".log")
    log_path.touch()
    rng, failures, released = random.Random(seed), [], 0
    started = time.time()
    options = [f"--nodes={processes}", *SLURM_OPTIONS, f"--output={log_path}"]
    job_id = slurm.sbatch(tree / "slurm" / "train.sbatch", *options, env=env, cwd=tree)
    log = Log(log_path)
    slot = 1
    next_kill = failure_time(started, mean_s, slot, rng)
    while (state := slurm.job(job_id)).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        log.poll()
        if committed(output_dir):
            next_kill = float("inf")
        restarts = int(state.get("Restarts", 0))
        if state.get("JobState") == "PENDING" and restarts > released:
            last = failures[-1] if failures else Failure(time.time(), None, None)  # (or the job's own requeue)
            last.events["pending"] = time.time() - last.at  # ended, requeued, held
            slurm.wait_idle()  # (a run started before the nodes cleaned up fails: "Job credential revoked")
            time.sleep(3)
            slurm.scontrol("update", f"JobId={job_id}", "StartTime=now", check=False)
            last.events["released"] = time.time() - last.at
            released = restarts
        if time.time() >= next_kill:
            running = state.get("JobState") == "RUNNING" and restarts == released
            # training: its banner seen, and a requeued run's resume line (a preemption before it would be read
            # with the previous run's resume)
            lines = [line for _, line in log.lines[log.run_started :]]
            trains = any(line.startswith("== ") for line in lines)
            trains = trains and (restarts == 0 or any(RESUMED.search(line) for line in lines))
            if running and trains:
                done = checkpoints(output_dir)
                urgent = log_path.with_name(f"urgent_{len(failures)}.log")
                slurm.sbatch(None, "--partition=urgent", f"--nodes={processes}", "--wrap=sleep 1", f"--output={urgent}")
                failures.append(Failure(time.time(), *(done[-1] if done else (None, None))))
                print(f"  {job}: preempted {time.time() - started:.0f} s in", file=sys.stderr, flush=True)
                slot += 1
                next_kill = failure_time(started, mean_s, slot, rng)
            else:
                next_kill = time.time() + 0.5  # not training yet: a moment later
        time.sleep(0.1)
    log.poll()
    wall_s = time.time() - started
    if state.get("JobState") != "COMPLETED":
        raise SystemExit(f"{job}: job {job_id} ended {state.get('JobState')}; see {log_path}")
    read_events(failures, log)
    return finished(output_dir, started, wall_s, failures)


def steps_redone(failure: Failure, steps_per_s: float) -> float | None:
    """0 when the restart resumed at the survivor's save; else the steps since the checkpoint it resumed from, at
    the fault-free pace (None: no resume seen before the next failure)."""
    if failure.resumed_step is None:
        return None
    if failure.rescued_step is not None and failure.resumed_step == failure.rescued_step:
        return 0.0
    if failure.latest_at is None:  # from scratch: every step since its start
        return None
    return max(0.0, (failure.at - failure.latest_at) * steps_per_s)


def same_weights(a: Path, b: Path) -> bool:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return first.keys() == second.keys() and all(first[key].equal(second[key]) for key in first)


def median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def row(tree: str, job: str, failure: str, mean_s: float, pairs: list[tuple[dict, dict, bool]]) -> dict:
    """One table row from `pairs` of (fault-free run, faulted run, bitwise equal), each pair run back to back: the
    goodput of each pair, its median and range; the failures' figures over every pair."""
    goodputs = sorted(clean["wall_s"] / faulted["wall_s"] for clean, faulted, _ in pairs)
    failures, redone = [], []
    for clean, faulted, _ in pairs:
        steps_per_s = clean["metrics"]["steps"] / clean["metrics"]["wall_time_s"]
        failures += faulted["failures"]
        redone += [
            value for failure in faulted["failures"] if (value := steps_redone(failure, steps_per_s)) is not None
        ]
    events = {
        name: median([failure.events[name] for failure in failures if name in failure.events])
        for name in ("detected", "requeued", "banner", "resumed", "first_step")
    }
    return {
        "tree": tree,
        "job": job,
        "failure": failure,
        "mean_s": mean_s,
        "pairs": len(pairs),
        "failures": len(failures),
        "clean_s": median([clean["wall_s"] for clean, _, _ in pairs]),
        "faulted_s": median([faulted["wall_s"] for _, faulted, _ in pairs]),
        "goodput": median(goodputs),
        "goodput_range": (goodputs[0], goodputs[-1]),
        "redone": sum(redone) / len(redone) if redone else None,
        "rescued": sum(failure.rescued_step is not None for failure in failures),
        **events,
        "cold_first_step": median([clean["metrics"]["first_step_at"] - clean["started"] for clean, _, _ in pairs]),
        "bitwise": all(bitwise for _, _, bitwise in pairs),
    }


def table(rows: list[dict]) -> str:
    def figure(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| tree | job | failure | T (s) | pairs | failures | fault-free s | faulted s | goodput (range) "
        "| steps redone / failure | saved for the restart | failure -> saved (or not) | -> requeued run | -> banner "
        "| -> resumed | -> first step (last) | cold first step | bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["goodput_range"]
        spread = f" ({low:.2f}-{high:.2f})" if r["pairs"] > 1 else ""
        lines.append(
            f"| {r['tree']} | {r['job']} | {r['failure']} | {r['mean_s']:.0f} | {r['pairs']} | {r['failures']} | "
            f"{r['clean_s']:.0f} | "
            f"{r['faulted_s']:.0f} | {r['goodput']:.2f}{spread} | {figure(r['redone'])} | "
            f"{r['rescued']}/{r['failures']} | "
            f"{figure(r['detected'], 2)} | {figure(r['requeued'])} | {figure(r['banner'])} | {figure(r['resumed'])} | "
            f"{figure(r['first_step'])} | {r['cold_first_step']:.1f} | {'yes' if r['bitwise'] else 'NO'} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["tree"], r["job"], r["failure"]) for r in rows}):
        points = sorted((r["mean_s"], r["goodput"]) for r in rows if (r["tree"], r["job"], r["failure"]) == key)
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=" ".join(key))
    axes.set_xlabel("time between failures (s)")
    axes.set_ylabel("goodput (fault-free / faulted wall time)")
    axes.set_ylim(0, 1.05)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS))
    parser.add_argument("--every-s", nargs="+", type=float, default=[60.0], help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0, help="the kills' times and victims")
    parser.add_argument("--trees", nargs="+", type=Path, default=[ROOT], help="the checkouts to run, in turn")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="pairs of fault-free and faulted runs (pair i's kills drawn with seed + i); the goodput is their median",
    )
    parser.add_argument(
        "--failure",
        choices=["rank-kill", "slurm-preemption"],
        default="rank-kill",
        help="rank-kill: SIGKILL a random rank under torchrun; slurm-preemption: the whole job preempted and "
        "requeued under a local SLURM (2 nodes on this host; needs slurmctld, slurmd and munged)",
    )
    parser.add_argument(
        "--recovery",
        nargs="+",
        choices=["restart", "in-process", "in-process-spare"],
        default=["restart"],
        help="rank-kill's recovery, each its own rows: torchrun's restart, or ddp-accel launch --recover in-process "
        "(the survivors keep their processes; in-process-spare: with --spares 1, a replacement imported ahead)",
    )
    parser.add_argument("--results", type=Path, default=HERE / "results" / "goodput.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="goodput_") as scratch, contextlib.ExitStack() as stack:
        if args.failure == "rank-kill":
            launchers = [(functools.partial(run_job, recovery=how), f"rank-kill ({how})") for how in args.recovery]
            what = "a rank killed"
        else:
            slurm = stack.enter_context(local_slurm(Path(scratch) / "slurm"))
            launchers, what = [(functools.partial(run_slurm_job, slurm), args.failure)], "the job preempted"
        for job, (launch, failure), (index, tree) in itertools.product(
            args.jobs, launchers, enumerate(tree.resolve() for tree in args.trees)
        ):
            label = "this" if tree == ROOT else tree.name
            folder = Path(scratch) / f"{job}_{index}_{failure.split()[-1].strip('()')}"
            launch(tree, job, folder / "warm-up", None, args.seed, ("--max-steps", "20"))
            pairs: dict[float, list] = {mean_s: [] for mean_s in args.every_s}
            for repeat in range(args.repeats):  # each fault-free run beside the faulted runs it is compared with
                print(f"{job} ({label}, pair {repeat + 1}/{args.repeats}): fault-free", file=sys.stderr, flush=True)
                clean = launch(tree, job, folder / f"clean_{repeat}", None, args.seed)
                for mean_s in args.every_s:
                    print(f"{job} ({label}): {what} every {mean_s:.0f} s", file=sys.stderr, flush=True)
                    faulted_dir = folder / f"every_{mean_s:.0f}_{repeat}"
                    faulted = launch(tree, job, faulted_dir, mean_s, args.seed + repeat)
                    pairs[mean_s].append((clean, faulted, same_weights(folder / f"clean_{repeat}", faulted_dir)))
                    line = row(label, job, failure, mean_s, pairs[mean_s][-1:])
                    print(table([line]).splitlines()[-1], file=sys.stderr)
                    shutil.rmtree(faulted_dir)  # (VGG-16's checkpoints: GBs per run)
                shutil.rmtree(folder / f"clean_{repeat}")
            rows += [row(label, job, failure, mean_s, pairs[mean_s]) for mean_s in args.every_s]
    text = table(rows)
    print(text)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python benchmarks/goodput.py", *sys.argv[1:]])
    args.results.write_text(f"`{command}` (seed {args.seed})\n\n{text}\n")
    plot(rows, args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
