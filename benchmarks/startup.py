"""Start-up and end: from the command to its first optimizer step, and from its last step to the command's return,
ddp_accel.fit against the plain-PyTorch DDP recipe (the same task as benchmarks/overhead.py), side by side.

    python benchmarks/startup.py --repeats 5

For 1 and 2 processes it alternates plain/ours whole commands (so machine noise hits both alike) and reports the
medians of: command -> first step, last step -> the command's return, and the whole command. A markdown table goes to
stdout and benchmarks/results/startup.md. The commands are those of overhead.py (`python` for 1 process; for 2,
torchrun for the recipe, accelerate launch and torchrun for ours), one epoch of the 512-wide MLP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from overhead import HERE, run_command

KEYS = ("startup", "end", "wall")


def run_one(loop: str, nproc: int, launcher: str) -> dict[str, float]:
    """One whole command: its start-up, its end and its wall time, in seconds."""
    output_dir = f"/tmp/ddp_accel_startup_{nproc}"
    command, env = run_command(loop, nproc, epochs=1, task="mlp", output_dir=output_dir, launcher_of_ours=launcher)
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False, cwd=HERE.parent)
    returned = time.time()
    if result.returncode != 0:
        raise SystemExit(f"{loop} x{nproc} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    line = json.loads(next(line for line in result.stdout.splitlines() if line.startswith('{"loop"')))
    return {
        "startup": line["first_step_at"] - started,
        "end": returned - line["last_step_at"],
        "wall": returned - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    rows = [
        "| processes (ours launched by) | command -> first step: plain | ours | last step -> return: plain | ours "
        "| whole command: plain | ours | ratio (ours / plain) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cases = [
        (nproc, launcher)
        for nproc in args.processes
        for launcher in (("accelerate", "torchrun") if nproc > 1 else ("python",))
    ]
    for nproc, launcher in cases:
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "ddp_accel": []}
        for repeat in range(args.repeats):
            for loop in ("plain", "ddp_accel") if repeat % 2 == 0 else ("ddp_accel", "plain"):
                runs[loop].append(run_one(loop, nproc, launcher))
                print(f"  x{nproc} {loop} ({launcher}): {runs[loop][-1]}", file=sys.stderr, flush=True)
        medians = {(loop, key): statistics.median(run[key] for run in runs[loop]) for loop in runs for key in KEYS}
        cells = [f"{medians[loop, key]:.2f} s" for key in KEYS for loop in ("plain", "ddp_accel")]
        ratio = medians["ddp_accel", "wall"] / medians["plain", "wall"]
        rows.append(f"| {nproc} ({launcher}) | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    table = "\n".join(rows)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    command = " ".join(["python", "benchmarks/startup.py", *sys.argv[1:]])
    (HERE / "results" / "startup.md").write_text(f"`{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
