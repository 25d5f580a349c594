"""The training stall per checkpoint, synchronous vs --async-checkpoint, and what the staging costs in memory.

    python benchmarks/async_checkpoint.py --repeats 2 --hidden 10000 --processes 2   # 103M parameters
    python benchmarks/async_checkpoint.py --repeats 2 --hidden 10000 --processes 1   # a core left to the writer

The driver launches this file under accelerate launch (`--processes`, gloo) twice per repeat, with and without
--async-checkpoint, alternating: the MLP of benchmarks/overhead_task.py (`--hidden` wide: 10000 -> 102.7M
parameters, AdamW: a checkpoint of 1.2 GB), a checkpoint every 4 steps, 16 steps. Each run reports, on the main
process, every step's wall time (from one step's end to the next): a step that follows a save holds the save's
stall (synchronous: the whole write; asynchronous: the staging copy, and the steps after it share the CPU with the
writer); the stall is that step's time minus the median of the steps far from any save. Memory: the peak RSS of the
main process (`ru_maxrss`), with and without. Markdown to stdout and benchmarks/results/async_checkpoint.md.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

EVERY, STEPS = 4, 16


def train(args: argparse.Namespace) -> None:
    import torch
    from overhead_task import build_task
    from torch.utils.data import DataLoader

    from ddp_accel import Callback, Task, TrainConfig, fit, make_accelerator

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, run) -> None:
            self.ends.append(time.perf_counter())

    config = TrainConfig.from_args(args)
    accelerator = make_accelerator(config)
    model, dataset, loss_fn = build_task("mlp", hidden=args.hidden)
    loader = DataLoader(dataset, batch_size=config.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = StepTimes()
    fit(accelerator, config, Task(model, optimizer, loader, loss_fn), callbacks=[times])
    steps = [later - earlier for earlier, later in zip(times.ends, times.ends[1:], strict=False)]
    accelerator.print(
        json.dumps(
            {
                "step_s": steps,  # steps[i]: from the end of step i+1 to the end of step i+2
                "parameters": sum(p.numel() for p in model.parameters()),
                "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
        )
    )


def stalls(step_s: list[float]) -> tuple[float, list[float]]:
    """The median step far from a save, and each save's stall (the step after it, minus that median)."""
    after_save = {step for step in range(EVERY, STEPS, EVERY)}  # the save at the end of step N stalls step N+1
    quiet = [s for i, s in enumerate(step_s, start=2) if (i - 1) not in after_save and (i - 2) not in after_save]
    base = statistics.median(quiet)
    return base, [step_s[step - 1] - base for step in sorted(after_save)]  # step_s[N-1]: step N+1


def drive(args: argparse.Namespace) -> None:
    from overhead import BIN, ROOT, free_port

    results: dict[str, list[dict]] = {"synchronous": [], "--async-checkpoint": []}
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        for repeat in range(args.repeats):
            for kind in results:
                command = [str(BIN / "accelerate"), "launch", "--config_file"]
                command += [str(ROOT / "accelerate_configs/multi_gpu.yaml"), "--num_processes", str(args.processes)]
                command += ["--main_process_port", str(free_port()), __file__, "--train", "--hidden", str(args.hidden)]
                command += ["--output-dir", str(Path(scratch) / kind), "--overwrite-output-dir", "--batch-size", "16"]
                command += ["--max-steps", str(STEPS), "--checkpointing-steps", str(EVERY), "--checkpoint-limit", "1"]
                command += ["--mixed-precision", "no", "--log-steps", "1000"]
                command += ["--async-checkpoint"] if kind != "synchronous" else []
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
                done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
                if done.returncode != 0:
                    raise SystemExit(f"{kind} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
                line = next(line for line in done.stdout.splitlines() if line.startswith('{"step_s"'))
                results[kind].append(json.loads(line))
                base, kept = stalls(results[kind][-1]["step_s"])
                print(
                    f"repeat {repeat + 1} {kind}: step {base:.2f} s, stalls {[round(s, 2) for s in kept]}",
                    file=sys.stderr,
                    flush=True,
                )
    parameters = results["synchronous"][0]["parameters"]
    lines = [
        f"MLP, {parameters / 1e6:.1f}M parameters (AdamW: a checkpoint of {parameters * 12 / 2**30:.2f} GiB), "
        f"{args.processes} gloo process(es), a checkpoint every {EVERY} steps, {STEPS} steps, {args.repeats} runs "
        "each, alternated:",
        "",
        "| checkpoints | a step far from a save | stall per save (median of all saves) | peak RSS, main process |",
        "|---|---|---|---|",
    ]
    for kind, runs in results.items():
        bases, all_stalls = zip(*(stalls(run["step_s"]) for run in runs), strict=True)
        rss = statistics.median(run["max_rss_gib"] for run in runs)
        stall = statistics.median(s for kept in all_stalls for s in kept)
        lines.append(f"| {kind} | {statistics.median(bases):.2f} s | {stall:.2f} s | {rss:.2f} GiB |")
    table = "\n".join(lines)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"async_checkpoint_{args.processes}.md").write_text(
        f"`python benchmarks/async_checkpoint.py --repeats {args.repeats} --hidden {args.hidden} --processes "
        f"{args.processes}`\n\n{table}\n"
    )


def main() -> None:
    if "--train" in sys.argv:
        from ddp_accel import ArgumentParser, add_training_args, run_main

        def script() -> None:
            parser = add_training_args(ArgumentParser())
            parser.add_argument("--train", action="store_true")
            parser.add_argument("--hidden", type=int, default=10000)
            train(parser.parse_args())

        run_main(script)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=10000)
    parser.add_argument("--processes", type=int, default=2, help="1: a core is left to the writer")
    parser.add_argument("--scratch", help="where the checkpoints go (default: the system's temporary folder)")
    drive(parser.parse_args())


if __name__ == "__main__":
    main()
