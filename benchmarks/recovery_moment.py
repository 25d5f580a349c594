"""One loss at a chosen moment under `ddp-accel launch --recover in-process`, in each checkout given, in turn: VGG-16
(134M parameters: a survivor's copy of the step is 1 GB with the optimizer's) on 3 CPU processes with
`--exact-micro-batch 4`; slot 1 is SIGKILLed DELAY seconds after the progress bar first shows step K. Prints when
each line about the loss appeared, in seconds after the kill: the survivors' save, the launcher's plan of the next
group, its resume, its first step done; then, once the replacement's imports are done, the survivors' hand-back:
the launcher's call, the group's resume (the replacement given the step: `from process N (given)`), its first
step done.

    python benchmarks/recovery_moment.py --trees . ../base --step 6 --delay-s 1.0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
JOB = ["scripts/imagenet.py", "--dummy", "-a", "vgg16", "--image-size", "32", "-b", "8", "-j", "0"]
JOB += ["--dummy-classes", "10", "--dummy-images", "960", "--epochs", "1", "--max-steps", "14"]
JOB += ["--checkpointing-steps", "1000", "--exact-micro-batch", "4", "--timeout-s", "60"]
SAID = re.compile(
    r"first step done|writes the step|writes step|saved the step|saved already|another survivor|from its memory|given\)"
    r"|generation \d"
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


CALLED = "(the launcher signals the survivors to hand the replacement its share back)"


def launchers_store(pid: int) -> Any:
    """A client of the launcher's store (its address in the process's environment): the key it sets as it asks
    for the hand-back, the moment neither version prints."""
    import torch.distributed as dist

    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    return dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False)


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
        store = launchers_store(victim)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        while launcher.poll() is None:
            for line in re.split(r"[\r\n]", log_path.read_text()):
                if line not in seen and SAID.search(line):
                    seen[line] = time.time() - killed_at
            with contextlib.suppress(Exception):  # (the launcher's store gone at its end)
                if CALLED not in seen and store.check(["ddp_accel/recovery/hand_back_1"]):
                    seen[CALLED] = time.time() - killed_at
            time.sleep(0.02)
    return launcher.returncode, seen


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
                print(f"{seconds:7.2f} s  {line[:140]}")
            shutil.rmtree(output_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
