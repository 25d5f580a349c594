"""GPU throughput: ResNet-50 on synthetic 224x224 images through scripts/imagenet.py, and a plain-PyTorch loop.

    python benchmarks/gpu_resnet50.py --out gpu_results           # needs a CUDA GPU
    python benchmarks/gpu_resnet50.py --plain-loop --precision bf16 --channels-last   # the baseline alone

Runs, one after another in one process tree on one card: the plain loop (pytorch/examples' inner loop, no
Accelerate) and scripts/imagenet.py with bf16 + channels_last alternately (`--repeats`), then imagenet.py's
other settings (fp16, no channels_last, fp32, torch.compile). Images/s are steady-state: the first log window
(cuDNN autotuning, compilation, worker start) is left out. Writes gpu_resnet50.md (a table) and the raw JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 20


def plain_loop(args) -> None:
    """What people write by hand: autocast + optional GradScaler, SGD, channels_last, pinned non-blocking copies."""
    import torch
    import torchvision
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT))
    from ddp_accel.vision.data import SyntheticImages

    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: only to try the script
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = torchvision.models.resnet50().to(device, memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}[args.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    dataset = SyntheticImages(100 * args.batch_size, 224, 1000)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=True,
        persistent_workers=True,
    )
    model.train()
    step, start = 0, None
    while step < args.steps:  # epochs of 100 batches, like imagenet.py --dummy
        for images, targets in loader:
            images = images.to(device, non_blocking=True).contiguous(memory_format=memory_format)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=args.precision != "no"):
                loss = torch.nn.functional.cross_entropy(model(images), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == WARMUP_STEPS:
                loss.item()  # waits for the GPU
                start = time.perf_counter()
            if step == args.steps:
                break
    loss.item()  # waits for the GPU
    elapsed = time.perf_counter() - start
    print(json.dumps({"plain_images_per_s": (args.steps - WARMUP_STEPS) * args.batch_size / elapsed}), flush=True)


def run(command: list[str], timeout: int) -> tuple[str, float]:
    tick = time.perf_counter()
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        result = subprocess.run(
            command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - tick
    if result.returncode != 0:
        print(f"FAILED: {' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}", flush=True)
        return "failed", time.perf_counter() - tick
    return result.stdout, time.perf_counter() - tick


def ours(args, name: str, extra: list[str]) -> dict:
    out = Path(args.runs_dir or Path(args.out) / "runs") / name.replace(" ", "_")
    command = [
        sys.executable,
        "scripts/imagenet.py",
        "--dummy",
        "-a",
        "resnet50",
        "-b",
        str(args.batch_size),
        "-j",
        str(args.workers),
        "--max-steps",
        str(args.steps),
        "-p",
        str(WARMUP_STEPS),
        "--output-dir",
        str(out),
        "--overwrite-output-dir",
        *extra,
    ]
    status, wall = run(command, args.timeout)
    if status in ("timeout", "failed"):
        return {"config": name, "status": status, "wall_s": wall}
    metrics = json.loads((out / "metrics.json").read_text())
    return {
        "config": name,
        "status": "ok",
        "images_per_s": metrics["steady_samples_per_s"],
        "data_wait_share": metrics["data_wait_share"],
        "wall_s": wall,
    }


def plain(args, extra: list[str]) -> dict:
    command = [
        sys.executable,
        __file__,
        "--plain-loop",
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--steps",
        str(args.steps),
        *extra,
    ]
    status, wall = run(command, args.timeout)
    if status in ("timeout", "failed"):
        return {"config": "plain", "status": status, "wall_s": wall}
    line = next(line for line in status.splitlines() if line.startswith('{"plain'))
    return {"config": "plain", "status": "ok", "images_per_s": json.loads(line)["plain_images_per_s"], "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--runs-dir", help="the runs' output folders (default OUT/runs)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
    parser.add_argument(
        "--headline-only", action="store_true", help="only the alternated plain / bf16+channels_last runs"
    )
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--plain-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    parser.add_argument("--channels-last", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_loop:
        return plain_loop(args)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: this benchmark measures GPU throughput")
    card = torch.cuda.get_device_name(0)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    headline = ["--mixed-precision", "bf16", "--channels-last"]
    results = []
    for _ in range(args.repeats):  # alternated, so drift hits both alike
        results.append(plain(args, ["--precision", "bf16", "--channels-last"]))
        results.append(ours(args, "bf16+channels_last", headline))
        print(json.dumps(results[-2:]), flush=True)
    for name, extra in (
        []
        if args.headline_only
        else [
            ("fp16+channels_last", ["--mixed-precision", "fp16", "--channels-last"]),
            ("bf16", ["--mixed-precision", "bf16"]),
            ("fp32 (TF32 convs)", ["--mixed-precision", "no", "--channels-last"]),
        ]
        + ([] if args.no_compile else [("bf16+channels_last+compile", headline + ["--compile"])])
    ):
        results.append(ours(args, name, extra))
        print(json.dumps(results[-1]), flush=True)

    def median(config: str):
        values = [r["images_per_s"] for r in results if r["config"] == config and r["status"] == "ok"]
        return statistics.median(values) if values else None

    plain_speed, ours_speed = median("plain"), median("bf16+channels_last")
    lines = [
        f"ResNet-50, synthetic 224x224, batch {args.batch_size}, {args.steps} steps per run "
        f"(first {WARMUP_STEPS} excluded), -j {args.workers}; card: **{card}**, torch {torch.__version__}",
        "",
        "| loop | settings | images/s | data wait | runs |",
        "|---|---|---|---|---|",
    ]
    for config in dict.fromkeys(r["config"] for r in results):
        runs = [r for r in results if r["config"] == config]
        speed = median(config)
        waits = [r["data_wait_share"] for r in runs if "data_wait_share" in r]
        failed = [r["status"] for r in runs if r["status"] != "ok"]
        lines.append(
            f"| {'plain PyTorch' if config == 'plain' else 'scripts/imagenet.py'} | "
            f"{'bf16+channels_last' if config == 'plain' else config} | "
            f"{f'{speed:,.0f}' if speed else '-'} | "
            f"{f'{statistics.median(waits):.1%}' if waits else '-'} | "
            f"{len(runs) - len(failed)} ok{''.join(f', 1 {status}' for status in failed)} |"
        )
    if plain_speed and ours_speed:
        lines += ["", f"ddp_accel / plain: **{ours_speed / plain_speed:.3f}**"]
    table = "\n".join(lines)
    print(table)
    (Path(args.out) / "gpu_resnet50.md").write_text(table + "\n")
    (Path(args.out) / "gpu_resnet50.json").write_text(json.dumps({"card": card, "results": results}, indent=1))


if __name__ == "__main__":
    main()
