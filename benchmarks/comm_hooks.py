"""How the gradients travel, side by side: bytes sent per step and samples/s, 2 processes.

    python benchmarks/comm_hooks.py --repeats 2 --hidden 2048
    python benchmarks/comm_hooks.py --repeats 3 --hidden 512 --only none exact-64 exact-16 exact-4

Runs benchmarks/overhead_accel.py (an MLP, `--hidden` wide, batch 64 a process) under accelerate launch with each
variant in turn, alternating: each --ddp-comm-hook (none, fp16, bf16, powersgd from step 3 at rank 4) and
--exact-micro-batch M (pieces of M samples, their gradients added along the ranks). It reports the median samples/s
and the bytes each rank sends per step, counted from the model's gradient shapes the way each variant packs them
(PowerSGD: torch's own rule for which matrices are worth compressing; exact: the running total, one gradient, sent
on once). A markdown table goes to stdout and benchmarks/results/comm_hooks.md (or comm_hooks_VARIANTS.md with --only).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from overhead import HERE, ROOT, run_command
from overhead_task import build_task

HOOKS = {
    "none": [],
    "fp16": ["--ddp-comm-hook", "fp16"],
    "bf16": ["--ddp-comm-hook", "bf16"],
    "powersgd": ["--ddp-comm-hook", "powersgd", "--powersgd-rank", "4", "--powersgd-start-step", "2"],
    **{f"exact-{m}": ["--exact-micro-batch", str(m)] for m in (64, 16, 4)},
}
BATCH = 64  # overhead_accel.py's batch a process
LABELS = {
    "powersgd": "--ddp-comm-hook powersgd (rank 4, from step 3)",
    **{f"exact-{m}": f"--exact-micro-batch {m} ({BATCH // m} pieces a batch)" for m in (64, 16, 4)},
}


def bytes_per_step(hook: str, hidden: int, rank: int = 4) -> int:
    """What each rank sends in the all-reduce(s) or the chain of running totals of one step (fp32 gradients)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    model, _, _ = build_task("mlp", hidden=hidden)
    total = 0
    for parameter in model.parameters():
        numel = parameter.numel()
        if hook in ("fp16", "bf16"):
            total += 2 * numel
        elif hook == "powersgd" and parameter.dim() > 1:
            rows, columns = parameter.shape[0], numel // parameter.shape[0]
            used = min(rows, columns, rank)
            total += 4 * ((rows + columns) * used if _should_compress(rows, columns, used, 2)[0] else numel)
        else:
            total += 4 * numel
    return total


def run_one(hook: str, hidden: int, epochs: int, output_dir: str) -> float:
    command, env = run_command("ours", 2, epochs, f"mlp-{hidden}", output_dir)
    result = subprocess.run(command + HOOKS[hook], capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{hook} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    line = next(line for line in result.stdout.splitlines() if line.startswith('{"loop"'))
    return json.loads(line)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=list(HOOKS), help="these variants (the first is the base)")
    args = parser.parse_args()
    variants = args.only or list(HOOKS)
    speeds: dict[str, list[float]] = {hook: [] for hook in variants}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for hook in variants:
                speeds[hook].append(run_one(hook, args.hidden, args.epochs, str(Path(scratch) / hook)))
                print(f"repeat {repeat + 1}: {hook} {speeds[hook][-1]:.0f} samples/s", file=sys.stderr, flush=True)
    base = variants[0]
    plain_bytes, plain_speed = bytes_per_step(base, args.hidden), statistics.median(speeds[base])
    lines = [
        f"MLP-{args.hidden}, 2 processes (gloo), batch 64 each, {args.epochs} epochs, median of {args.repeats}:",
        "",
        f"| variant | bytes sent per step and rank | vs {base} | samples/s | vs {base} |",
        "|---|---|---|---|---|",
    ]
    for hook in variants:
        sent, speed = bytes_per_step(hook, args.hidden), statistics.median(speeds[hook])
        label = LABELS.get(hook, f"--ddp-comm-hook {hook}" if hook != "none" else "none (DDP's all-reduce)")
        lines.append(f"| {label} | {sent:,} | {sent / plain_bytes:.3f}x | {speed:,.0f} | {speed / plain_speed:.2f}x |")
    table = "\n".join(lines)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    only = f" --only {' '.join(args.only)}" if args.only else ""
    name = f"comm_hooks_{'_'.join(args.only)}.md" if args.only else "comm_hooks.md"
    (HERE / "results" / name).write_text(
        f"`python benchmarks/comm_hooks.py --repeats {args.repeats} --hidden {args.hidden}{only}`\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
