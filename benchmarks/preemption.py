"""Signal to saved: how long after SIGTERM reaches every process of a job (launcher, ranks, DataLoader workers) the
checkpoint of the step reached is complete, for the test probe and for imagenet.py with resnet50.

    python benchmarks/preemption.py --repeats 3

Each repeat starts the job under torchrun (2 processes, 2 DataLoader workers each), waits until it trains, signals
every process of the tree at once (what SLURM does to a job step), and times the signal -> preempted.json interval
(the save itself is preempted.json's save_s). A markdown table goes to stdout and benchmarks/results/preemption.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers import free_port, process_tree  # noqa: E402  (the process table, read as the tests read it)

JOBS = {
    "probe (Linear 8-16-2)": [
        "tests/probe.py",
        "--batch-size",
        "4",
        "--epochs",
        "50",
        "--train-size",
        "256",
        "--workers",
        "2",
        "--step-ms",
        "20",
    ],
    "imagenet.py resnet50 (--dummy, 64 px, batch 4)": [
        "scripts/imagenet.py",
        "--dummy",
        "-a",
        "resnet50",
        "--image-size",
        "64",
        "-b",
        "4",
        "-j",
        "2",
        "--dummy-classes",
        "100",
        "--epochs",
        "50",
    ],
}


def once(job: list[str], work: Path) -> tuple[float, float, int]:
    """(signal -> preempted.json seconds, save_s, processes signalled)."""
    out = work / "out"
    log = open(work / "log", "w")
    command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), *job]
    command += ["--output-dir", str(out), "--overwrite-output-dir"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agent = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        # the agent, 2 ranks and 4 workers
        while "train:" not in (work / "log").read_text() or len(process_tree(agent.pid)) < 7:
            if time.monotonic() > deadline or agent.poll() is not None:
                raise SystemExit((work / "log").read_text()[-3000:])
            time.sleep(0.1)
        time.sleep(2.0)  # well into training
        pids = process_tree(agent.pid)
        sent = time.monotonic()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        marker = out / "preempted.json"
        while not marker.is_file():
            if time.monotonic() - sent > 120:
                raise SystemExit("no checkpoint 120 s after the signal:\n" + (work / "log").read_text()[-3000:])
            time.sleep(0.005)
        saved_after = time.monotonic() - sent
        agent.wait(timeout=120)
        return saved_after, json.loads(marker.read_text())["save_s"], len(pids)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lines = [
        f"Measured by `python benchmarks/preemption.py --repeats {args.repeats}` (torchrun, 2 CPU processes, 2 "
        "DataLoader workers each; SIGTERM to every process of the tree at once, 2 s into training)",
        "",
        "| job | processes signalled | signal -> checkpoint complete (s), median | save itself (s), median | runs |",
        "|---|---|---|---|---|",
    ]
    for name, job in JOBS.items():
        results = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(once(job, Path(tmp)))
        after = statistics.median(r[0] for r in results)
        save = statistics.median(r[1] for r in results)
        runs = ", ".join(f"{r[0]:.2f}" for r in results)
        lines.append(f"| {name} | {results[0][2]} | {after:.2f} | {save:.2f} | {runs} |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    (HERE / "results" / "preemption.md").write_text(text)


if __name__ == "__main__":
    main()
