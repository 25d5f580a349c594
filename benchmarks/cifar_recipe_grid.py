"""How far does each recipe ingredient take the CIFAR command, and how much compute does it need? Runs the
documented CIFAR-10 mini command of scripts/imagenet.py (docs/imagenet.md) with ingredients added, several runs at
once, on one machine (a GPU, whose one card the runs share, makes a grid of 40-100 epoch runs take minutes), and
tables each run's held-out top-1 (raw and EMA weights, every epoch) against the images it trained on, so that a
recipe can be chosen for the time a CPU has.

    python benchmarks/cifar_recipe_grid.py cifar10_mini --out results/ --parallel 5 -j 3 --budget-s 420
    python benchmarks/cifar_recipe_grid.py cifar10_mini --out /tmp/g --only base --epochs-scale 0.05   # a smoke run

DATA_DIR holds train/<class>/*.jpg and val/<class>/*.jpg. Writes OUT/cifar_recipe_grid.json (every evaluation of
every run) and OUT/cifar_recipe_grid.md (one line a run). Runs still going at --budget-s are stopped and reported
with what they evaluated (`complete: false`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the documented command (docs/imagenet.md), less its --epochs, -a and --time-budget (the grid measures epochs)
COMMAND = (
    "--image-size 32 --augment cifar --mean 0.4914 0.4822 0.4465 --std 0.247 0.243 0.261 -b 128 --lr 0.1 "
    "--wd 5e-4 --lr-schedule cosine --warmup-epochs 1 --label-smoothing 0.1 --channels-last --mixed-precision auto"
).split()
EMA_TTA = "--ema-decay 0.998 --ema-warmup --tta-flip".split()
TA = ["--auto-augment", "trivialaugment"]
CUTMIX = ["--cutmix-alpha", "1.0"]

# name: (arch, epochs, extra options); the longest first, so that a budget cuts the short ones last
GRID: dict[str, tuple[str, int, list[str]]] = {
    "w64_80ep_ta_cutmix": ("cifar_resnet9", 80, TA + CUTMIX + EMA_TTA),
    "w32_70ep": ("cifar_resnet9_w32", 70, EMA_TTA),
    "w32_70ep_ta": ("cifar_resnet9_w32", 70, TA + EMA_TTA),
    "w32_70ep_cutmix": ("cifar_resnet9_w32", 70, CUTMIX + EMA_TTA),
    "w32_70ep_ta_cutmix": ("cifar_resnet9_w32", 70, TA + CUTMIX + EMA_TTA),
    "w16_60ep_ta": ("cifar_resnet9_w16", 60, TA + EMA_TTA),
    "base": ("cifar_resnet9_w32", 40, []),
    "w64_25ep_ta": ("cifar_resnet9", 25, TA + EMA_TTA),
    "w32_20ep": ("cifar_resnet9_w32", 20, EMA_TTA),
    # the candidates for 15 minutes on a CPU with AMX (40 epochs took 535 s there)
    "w32_60ep": ("cifar_resnet9_w32", 60, EMA_TTA),
    "w32_60ep_seed1": ("cifar_resnet9_w32", 60, [*EMA_TTA, "--seed", "1"]),
    "w32_60ep_ta": ("cifar_resnet9_w32", 60, TA + EMA_TTA),
    "w32_50ep": ("cifar_resnet9_w32", 50, EMA_TTA),
}


def read_history(folder: Path) -> list[dict]:
    try:
        return json.loads((folder / "history.json").read_text())
    except (OSError, ValueError):
        return []


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def summary(name: str, run: dict) -> dict:
    arch, epochs, extra = GRID[name]
    history = read_history(run["folder"])
    last = history[-1] if history else {}
    return {
        "name": name,
        "arch": arch,
        "epochs": epochs,
        "options": " ".join(extra),
        "complete": run.get("returncode") == 0,
        "returncode": run.get("returncode"),
        "seconds": round(run.get("ended", time.time()) - run["started"], 1),
        "samples": last.get("samples", 0),
        "top1": last.get("eval_top1"),
        "ema_top1": last.get("ema_top1"),
        "best_top1": max((r.get("eval_top1", 0) for r in history), default=None),
        "best_ema_top1": max((r.get("ema_top1", 0) for r in history), default=None) if "ema_top1" in last else None,
        "log_tail": "" if run.get("returncode") == 0 else log_tail(run["folder"].with_suffix(".log")),
        "history": [
            {k: r[k] for k in ("epoch", "samples", "train_loss", "eval_loss", "eval_top1", "ema_top1") if k in r}
            for r in history
        ],
    }


def percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.2f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parallel", type=int, default=4, help="runs at once")
    parser.add_argument("-j", "--workers", type=int, default=3, help="DataLoader workers per run")
    parser.add_argument("--budget-s", type=float, default=420, help="stop what still runs after this")
    parser.add_argument("--only", nargs="+", choices=sorted(GRID), help="these runs only")
    parser.add_argument("--runs-dir", type=Path, help="the runs' output folders (default: OUT/grid_runs)")
    parser.add_argument("--epochs-scale", type=float, default=1.0, help="scale every run's epochs (smoke runs)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs_dir = args.runs_dir or args.out / "grid_runs"
    pending = [name for name in GRID if not args.only or name in args.only]
    running: dict[str, dict] = {}
    done: dict[str, dict] = {}
    start = time.time()
    while pending or running:
        while pending and len(running) < args.parallel and time.time() - start < args.budget_s:
            name = pending.pop(0)
            arch, epochs, extra = GRID[name]
            folder = runs_dir / name
            command = [sys.executable, str(ROOT / "scripts" / "imagenet.py"), args.data, "-a", arch, *COMMAND]
            command += [*extra, "--epochs", str(max(1, round(epochs * args.epochs_scale))), "-j", str(args.workers)]
            command += ["--output-dir", str(folder), "--overwrite-output-dir"]
            folder.mkdir(parents=True, exist_ok=True)
            log = open(folder.with_suffix(".log"), "w")
            # its own session: the stop at the budget reaches its DataLoader workers too
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            running[name] = {"process": process, "folder": folder, "started": time.time(), "log": log}
            print(f"[{time.time() - start:5.0f} s] started {name}", flush=True)
        for name, run in list(running.items()):
            code = run["process"].poll()
            if code is None and time.time() - start > args.budget_s:
                os.killpg(run["process"].pid, signal.SIGKILL)
                code = run["process"].wait()
            if code is not None:
                run.update(returncode=code, ended=time.time())
                run["log"].close()
                done[name] = summary(name, running.pop(name))
                row = done[name]
                print(
                    f"[{time.time() - start:5.0f} s] {name}: rc {code}, {row['seconds']} s, top1 {percent(row['top1'])}"
                    f" ema {percent(row['ema_top1'])}",
                    flush=True,
                )
        if pending and time.time() - start > args.budget_s:
            for name in pending:
                done[name] = {"name": name, "complete": False, "returncode": None, "history": []}
            pending = []
        time.sleep(1)
    rows = [done[name] for name in GRID if name in done]
    (args.out / "cifar_recipe_grid.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| run | -a | epochs | options | images | val top-1 (EMA) at the end | best (EMA best) | s | complete |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row.get("history"):
            lines.append(f"| {row['name']} | | | | 0 | | | | not run |")
            continue
        lines.append(
            f"| {row['name']} | {row['arch']} | {row['epochs']} | {row['options']} | {row['samples']:,} | "
            f"{percent(row['top1'])} ({percent(row['ema_top1'])}) | {percent(row['best_top1'])} "
            f"({percent(row['best_ema_top1'])}) | {row['seconds']} | {row['complete']} |"
        )
    (args.out / "cifar_recipe_grid.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
