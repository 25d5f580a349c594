"""k-fold cross-validation of imdb.py's options: each candidate trained K times, each time with another fold of the
training data held out (`--fold I/K`), so that every review is held out once; the mean and the spread of the
held-out accuracy choose between candidates, not one split (whose figure moves by about a point with the split).

    python benchmarks/kfold.py --train-file imdb_train.jsonl.gz --folds 5 \\
        --candidate "defaults=" --candidate "no decay=--weight-decay 0" --out results/kfold

Each candidate is NAME=OPTIONS (options as on imdb.py's command line, added to --common). Writes OUT/kfold.json
and OUT/kfold.md (a table: candidate, each fold, mean, standard deviation, seconds per run) after every run, so an
interrupted benchmark keeps what it measured; a run already in kfold.json is not repeated.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_fold(train_file: str, options: list[str], fold: str, work: Path) -> dict:
    output_dir = work / f"fold_{fold.replace('/', '_of_')}"
    command = [sys.executable, str(ROOT / "scripts" / "imdb.py"), "--train-file", train_file, "--fold", fold]
    command += [*options, "--output-dir", str(output_dir), "--overwrite-output-dir"]
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        raise SystemExit(f"fold {fold} of {shlex.join(options)} failed: {(errors or [result.stderr[-2000:]])[0]}")
    metrics = json.loads((output_dir / "metrics.json").read_text())
    return {"accuracy": metrics["eval_accuracy"], "seconds": round(seconds, 1), "samples": metrics["eval_samples"]}


def table(results: dict, folds: int) -> str:
    lines = [
        f"| candidate | options | {' | '.join(f'fold {i}' for i in range(1, folds + 1))} | mean | std | s/run |",
        "|---|---|" + "---|" * (folds + 3),
    ]
    for name, entry in results.items():
        runs = entry["runs"]
        scores = [
            runs[f"{i}/{folds}"]["accuracy"] * 100 if f"{i}/{folds}" in runs else None for i in range(1, folds + 1)
        ]
        done = [score for score in scores if score is not None]
        mean = f"**{statistics.mean(done):.2f}%**" if done else ""
        spread = f"{statistics.stdev(done):.2f}" if len(done) > 1 else ""
        seconds = f"{statistics.mean(run['seconds'] for run in runs.values()):.0f}" if runs else ""
        cells = " | ".join(f"{score:.2f}" if score is not None else "" for score in scores)
        lines.append(f"| {name} | `{entry['options'] or '(defaults)'}` | {cells} | {mean} | {spread} | {seconds} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-file", required=True, help="the training data (jsonl/csv/parquet, text and label)")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--candidate", action="append", required=True, metavar="NAME=OPTIONS")
    parser.add_argument("--common", default="", help="options every run gets (e.g. --seed 0)")
    parser.add_argument("--out", default="kfold_results")
    args = parser.parse_args()
    if args.folds < 2:
        parser.error("--folds must be at least 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kfold.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="kfold_") as work:
        for candidate in args.candidate:
            name, _, options = candidate.partition("=")
            entry = results.setdefault(name, {"options": options, "runs": {}})
            for index in range(1, args.folds + 1):
                fold = f"{index}/{args.folds}"
                if fold in entry["runs"]:
                    continue
                entry["runs"][fold] = run_fold(
                    args.train_file, [*shlex.split(args.common), *shlex.split(options)], fold, Path(work)
                )
                print(f"{name} fold {fold}: {entry['runs'][fold]['accuracy']:.4f}", flush=True)
                path.write_text(json.dumps(results, indent=1))
                (out / "kfold.md").write_text(table(results, args.folds))
    print(table(results, args.folds))


if __name__ == "__main__":
    main()
