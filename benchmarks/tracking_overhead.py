"""The cost of tracking: the same training run with --report-to none / tensorboard / mlflow / wandb (offline),
alternated in one run, one process on the CPU; median samples/s and the ratio to no tracking.

    python benchmarks/tracking_overhead.py --repeats 3
    python benchmarks/tracking_overhead.py --log-steps 1      # the worst case: log every step
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRACKERS = ["none", "tensorboard", "mlflow", "wandb"]


def run_one(report_to: str, args, output_dir: str) -> float:
    command = [
        sys.executable,
        str(HERE / "overhead_accel.py"),
        "--task",
        "mlp",
        "--hidden",
        str(args.hidden),
        "--epochs",
        str(args.epochs),
        "--log-steps",
        str(args.log_steps),
        "--report-to",
        report_to,
        "--output-dir",
        output_dir,
        "--overwrite-output-dir",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(os.cpu_count() or 1),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"--report-to {report_to} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    line = next(line for line in result.stdout.splitlines() if line.startswith('{"loop"'))
    return json.loads(line)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048, help="MLP width (2048: a ~30 ms step on 2 cores)")
    parser.add_argument("--log-steps", type=int, default=20)
    args = parser.parse_args()
    speeds = {name: [] for name in TRACKERS}
    with tempfile.TemporaryDirectory() as work:
        for repeat in range(args.repeats):
            for name in TRACKERS if repeat % 2 == 0 else reversed(TRACKERS):
                speeds[name].append(run_one(name, args, f"{work}/{name}"))
                print(f"  {name}: {speeds[name][-1]:.0f} samples/s", file=sys.stderr, flush=True)
    baseline = statistics.median(speeds["none"])
    rows = [
        f"`python benchmarks/tracking_overhead.py --repeats {args.repeats} --hidden {args.hidden} "
        f"--log-steps {args.log_steps}`",
        "",
        "| --report-to | samples/s (median) | ratio to none |",
        "|---|---|---|",
    ]
    rows += [
        f"| {name} | {statistics.median(speeds[name]):,.0f} | {statistics.median(speeds[name]) / baseline:.3f} |"
        for name in TRACKERS
    ]
    table = "\n".join(rows)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"tracking_overhead_log{args.log_steps}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
