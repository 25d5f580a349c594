"""One loss at a chosen moment under `ddp-accel launch --recover in-process`, in each checkout given, in turn: VGG-16
(134M parameters: a survivor's copy of the step is 1 GB with the optimizer's) on 3 CPU processes with
`--exact-micro-batch 4`; slot 1 is SIGKILLed DELAY seconds after the progress bar first shows step K. Prints when
each line about the loss appeared, in seconds after the kill: the survivors' save, the launcher's plan of the next
group, its resume, its first step done; then, once the replacement's imports are done and the survivors hand its
share back, how long after the launcher's call the whole group resumed and completed its first step.

    python benchmarks/recovery_moment.py --trees . ../base --step 6 --delay-s 1.0
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
JOB = ["scripts/imagenet.py", "--dummy", "-a", "vgg16", "--image-size", "32", "-b", "8", "-j", "0"]
JOB += ["--dummy-classes", "10", "--dummy-images", "960", "--epochs", "1", "--max-steps", "14"]
JOB += ["--checkpointing-steps", "1000", "--exact-micro-batch", "4", "--timeout-s", "60"]
SAID = re.compile(
    r"first step done|writes the step|saved the step|saved already|another survivor|from its memory|generation \d"
    r"|resumed from|error"
)


def slot_1(output_dir: Path) -> int | None:
    """The training process of slot 1 (its launcher's variable)."""
    found = subprocess.run(["pgrep", "-f", "--", f"--output-dir {output_dir}"], capture_output=True, text=True)
    for pid in map(int, found.stdout.split()):
        try:
            environ, cmdline = Path(f"/proc/{pid}/environ").read_bytes(), Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"DDP_ACCEL_RECOVERY_SLOT=1\0" in environ and b"imagenet.py" in cmdline:
            return pid
    return None


def one_loss(tree: Path, output_dir: Path, step: int, delay_s: float) -> tuple[int, dict[str, float]]:
    """The job from `tree`, slot 1 killed at the moment; (the launcher's exit code, each line -> seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
    argv = [str(BIN / "ddp-accel"), "launch", "--recover", "in-process", "--num_processes", "3", *JOB]
    log_path, seen = output_dir.with_suffix(".log"), {}
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(
            [*argv, "--output-dir", str(output_dir)], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        shown = re.compile(r"\| (\d+)/\d+")  # the progress bar's steps
        while launcher.poll() is None and max(map(int, shown.findall(log_path.read_text())), default=0) < step:
            time.sleep(0.05)
        time.sleep(delay_s)
        victim = slot_1(output_dir)
        if victim is None:
            raise SystemExit(f"{tree}: no process of slot 1 to kill; see {log_path}")
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        while launcher.poll() is None:
            for line in re.split(r"[\r\n]", log_path.read_text()):
                bar = shown.search(line)
                key = line if SAID.search(line) else f"progress {bar.group(1)}" if bar else None
                if key is not None and key not in seen:
                    seen[key] = time.time() - killed_at
            time.sleep(0.02)
    return launcher.returncode, seen


def hand_back(seen: dict[str, float]) -> str:
    """When the replacement's group resumed and completed its first step, after the launcher's call for it."""
    called = next((at for line, at in seen.items() if "take their share back" in line), None)
    resumed = [(at, line) for line, at in seen.items() if called is not None and at > called and "resumed from" in line]
    if not resumed:
        return "hand-back: not seen"
    at, line = min(resumed)
    step = int(re.search(r": step (\d+)", line).group(1))
    done = [seconds for key, seconds in seen.items() if key.startswith("progress ") and int(key.split()[1]) > step]
    first = f"{min(done) - called:.2f} s" if done else "not seen"
    return f"hand-back: resumed {at - called:.2f} s after the call, its first step done {first} after it"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=Path, default=[HERE.parent], help="the checkouts, in turn")
    parser.add_argument("--step", type=int, default=6, help="the kill comes after the progress bar shows this step")
    parser.add_argument("--delay-s", type=float, default=1.0, help="seconds after it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="recovery_moment_") as scratch:
        for index, tree in enumerate(tree.resolve() for tree in args.trees):
            output_dir = Path(scratch) / f"{index}_{tree.name}"
            code, seen = one_loss(tree, output_dir, args.step, args.delay_s)
            print(f"== {tree} (exit {code})")
            for line, seconds in seen.items():
                if not line.startswith("progress "):
                    print(f"{seconds:7.2f} s  {line[:140]}")
            print(hand_back(seen))
            shutil.rmtree(output_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
