"""Loop overhead: ddp_accel.fit vs the plain-PyTorch DDP recipe, same task, side by side in one run.

    python benchmarks/overhead.py --repeats 3

For 1 and 2 processes it alternates plain/ours runs (so machine noise hits both alike) and reports
the median samples/s of each and their ratio. A markdown table goes to stdout and benchmarks/results/.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_command(
    loop: str, nproc: int, epochs: int, task: str, output_dir: str, launcher_of_ours: str = "accelerate"
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one run: the plain recipe (python, or torchrun) or ours (python, or
    accelerate launch / torchrun), `nproc` processes sharing the machine's cores."""
    name, _, hidden = task.partition("-")
    task_args = ["--task", name] + (["--hidden", hidden] if hidden else [])
    if loop == "plain":
        script = [str(HERE / "overhead_plain.py"), "--epochs", str(epochs), *task_args]
        launcher = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    else:
        script = [str(HERE / "overhead_accel.py"), "--epochs", str(epochs), *task_args]
        script += ["--output-dir", output_dir, "--overwrite-output-dir"]
        launcher = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs/multi_gpu.yaml")]
        launcher += ["--num_processes", str(nproc), "--main_process_port", str(free_port())]
        if launcher_of_ours == "torchrun":
            launcher = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    command = (launcher if nproc > 1 else [sys.executable]) + script
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc)),
        "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    return command, env


def run_one(loop: str, nproc: int, epochs: int, task: str, output_dir: str) -> float:
    command, env = run_command(loop, nproc, epochs, task, output_dir)
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{loop} x{nproc} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    line = next(line for line in result.stdout.splitlines() if line.startswith('{"loop"'))
    return json.loads(line)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=["mlp-512", "mlp-2048", "resnet20"],
        help="mlp-WIDTH (mlp-512: a ~2 ms step on 2 cores, the worst case for per-step overhead) "
        "or resnet20 (CIFAR ResNet-20, 32x32 images)",
    )
    args = parser.parse_args()
    rows = ["| task | processes | plain DDP samples/s | ddp_accel samples/s | ratio |", "|---|---|---|---|---|"]
    for task, nproc in ((task, nproc) for task in args.tasks for nproc in args.processes):
        speeds = {"plain": [], "ddp_accel": []}
        for repeat in range(args.repeats):
            for loop in ("plain", "ddp_accel") if repeat % 2 == 0 else ("ddp_accel", "plain"):
                speeds[loop].append(run_one(loop, nproc, args.epochs, task, f"/tmp/ddp_accel_bench_{nproc}"))
                print(f"  {task} x{nproc} {loop}: {speeds[loop][-1]:.0f} samples/s", file=sys.stderr, flush=True)
        plain, ours = statistics.median(speeds["plain"]), statistics.median(speeds["ddp_accel"])
        rows.append(f"| {task} | {nproc} | {plain:,.0f} | {ours:,.0f} | {ours / plain:.3f} |")
    table = "\n".join(rows)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    name = "overhead.md" if args.tasks == parser.get_default("tasks") else f"overhead_{'_'.join(args.tasks)}.md"
    (HERE / "results" / name).write_text(
        f"`python benchmarks/overhead.py --repeats {args.repeats} --tasks {' '.join(args.tasks)}`\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
