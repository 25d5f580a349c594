"""The checks a CPU-only CI cannot make, in one run on one GPU; results in OUT/gpu_check.json and gpu_check.md.

    python benchmarks/gpu_check.py --out results/ --budget-s 330          # every check, within the budget
    python benchmarks/gpu_check.py --out results/ --only fsdp_template     # one check again

Checks (each a real launch of a project script, as a user would type it, `--num_processes 1` on one GPU):
  environment      torch/CUDA/card, and first-use costs on a fresh machine (matplotlib's font cache, CUDA init)
  fsdp_template    scripts/template.py under accelerate_configs/fsdp.yaml: a real FSDP run, a sharded checkpoint,
                   resume from it (bitwise equal weights), model.safetensors loadable by the bare model
  nccl_restart     torchrun --max_restarts 2, SIGKILL the worker after a checkpoint: the restarted NCCL group
                   resumes and ends with the uninterrupted run's weights
  mixed_precision  imdb.py (bag, gcnn) and imagenet.py under fp16 (gradient scaler) and bf16: the loss falls,
                   skipped steps are counted, resume restores the scaler's scale
  fsdp_imagenet    scripts/imagenet.py under fsdp.yaml: checkpoint, resume, full weights
  pipeline         ResNet-50 --dummy, bf16 + channels_last: float batches from the loader vs uint8 batches
                   normalised on the GPU, alternated: images/s and the share of step time waiting for data
  ray_gpu          ddp-accel ray --workers 1 --gpus-per-worker 1 (a local Ray, NCCL): SIGKILL of the worker after a
                   checkpoint, the group restarts and resumes; the end compared with torchrun on the same GPU
  auto_batch       imagenet.py --auto-batch-size with the GPU's memory capped: the real out-of-memory error, the
                   micro-batch found, the accumulation raised, the run completes
  compile_gpu      imagenet.py --compile (inductor) against eager on the GPU: images/s, compile time, and the
                   exported weights load into the bare torchvision model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FSDP_YAML = ROOT / "accelerate_configs" / "fsdp.yaml"
PY = sys.executable


class Runner:
    def __init__(self, out: Path, budget_s: float):
        self.out, self.deadline = out, time.monotonic() + budget_s
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.logs = self.work / "logs"  # every command's full output; packed into OUT/logs.tar.gz
        self.logs.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list, timeout: float = 120) -> dict:
        """Run a command; keep its output in logs/NAME.log; return rc, seconds and the output's tail."""
        timeout = max(5.0, min(timeout, self.left()))
        started = time.monotonic()
        process = subprocess.Popen(
            [str(part) for part in command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=self.env,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)  # torch elastic starts its workers in sessions of their own
            output, _ = process.communicate()
            output += f"\n[gpu_check: killed after {timeout:.0f} s]"
        (self.logs / f"{name}.log").write_text(output)
        return {
            "rc": process.returncode,
            "seconds": round(time.monotonic() - started, 1),
            "tail": output[-1500:],
            "output": output,
        }

    def accelerate(self, name: str, script: str, *args, config: Path = FSDP_YAML, timeout: float = 150) -> dict:
        return self.run(
            name,
            [
                PY,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                config,
                "--num_processes",
                1,
                "--num_machines",
                1,
                script,
                *args,
            ],
            timeout,
        )


def kill_tree(pid: int) -> None:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    todo, found = [pid], []
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    for victim in found:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def metrics(output_dir: Path) -> dict:
    path = output_dir / "metrics.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def banner_value(output: str, key: str) -> str | None:
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == key:
            return " ".join(parts[1:])
    return None


def max_difference(dir_a: Path, dir_b: Path) -> dict:
    """Bitwise equality and the largest absolute difference of two model.safetensors."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(dir_a / "model.safetensors")), load_file(str(dir_b / "model.safetensors"))
    if a.keys() != b.keys():
        return {"same_keys": False}
    diff = max((a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0 for k in a)
    return {"same_keys": True, "bitwise_equal": all(torch.equal(a[k], b[k]) for k in a), "max_abs_diff": diff}


def resume_from(runner: Runner, full: Path, step: int, name: str) -> Path:
    cut = runner.work / name
    shutil.copytree(full / "checkpoints" / f"step_{step}", cut / "checkpoints" / f"step_{step}")
    return cut


def check_environment(runner: Runner) -> dict:
    import torch

    result = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    for package in ("accelerate", "torchvision", "datasets", "pyarrow", "fsspec", "safetensors"):
        try:
            result[package] = __import__(package).__version__
        except Exception as error:  # a missing or broken package is a finding, not a crash
            result[package] = f"{type(error).__name__}: {error}"
    # the first run on a fresh machine was slow once: time the first-use costs, each twice
    for label, code in (
        (
            "matplotlib_font_cache",
            "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as p; p.figure()",
        ),
        (
            "cuda_init",
            "import torch; torch.zeros(1, device='cuda' if torch.cuda.is_available() else 'cpu').sum().item()",
        ),
    ):
        result[label + "_s"] = [runner.run(f"env_{label}_{i}", [PY, "-c", code], 120)["seconds"] for i in (1, 2)]
    return result


def check_fsdp_template(runner: Runner) -> dict:
    full, common = runner.work / "tpl_full", ["--epochs", 2, "--checkpointing-steps", 5, "--batch-size", 256]
    first = runner.accelerate("fsdp_template_full", "scripts/template.py", *common, "--output-dir", full)
    result = {
        "rc": first["rc"],
        "seconds": first["seconds"],
        "distributed_type": banner_value(first["output"], "distributed_type"),
        "metrics": {k: metrics(full).get(k) for k in ("steps", "test_accuracy", "world_size", "mixed_precision")},
    }
    if first["rc"] != 0:
        return {**result, "tail": first["tail"]}
    step5 = full / "checkpoints" / "step_5"
    result["checkpoint_files"] = sorted(str(p.relative_to(step5)) for p in step5.rglob("*") if p.is_file())[:20]
    cut = resume_from(runner, full, 5, "tpl_cut")
    second = runner.accelerate(
        "fsdp_template_resume",
        "scripts/template.py",
        *common,
        "--output-dir",
        cut,
        "--resume-from-checkpoint",
        "latest",
    )
    result["resume"] = {"rc": second["rc"], "resumed": "resumed from" in second["output"], **max_difference(full, cut)}
    if second["rc"] != 0:
        result["resume"]["tail"] = second["tail"]
    import torch
    from safetensors.torch import load_file

    bare = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
    )
    state = load_file(str(full / "model.safetensors"))
    bare.load_state_dict(state, strict=True)
    result["full_weights"] = {key: list(value.shape) for key, value in state.items() if key.endswith("weight")}
    return result


def check_fsdp_imagenet(runner: Runner) -> dict:
    full = runner.work / "in_full"
    # --mixed-precision no: FSDP2's bf16 parameters with BatchNorm's fp32 running statistics fail in cuDNN's
    # backward ("Expected running_mean to have type BFloat16 but got Float"; seen on an H200, torch 2.11)
    common = [
        "--dummy",
        "-a",
        "resnet18",
        "--image-size",
        64,
        "--dummy-classes",
        10,
        "-b",
        32,
        "-j",
        2,
        "--max-steps",
        20,
        "--checkpointing-steps",
        10,
        "--deterministic",
        "--lr",
        0.05,
        "--mixed-precision",
        "no",
    ]
    first = runner.accelerate("fsdp_imagenet_full", "scripts/imagenet.py", *common, "--output-dir", full)
    result = {
        "rc": first["rc"],
        "seconds": first["seconds"],
        "distributed_type": banner_value(first["output"], "distributed_type"),
    }
    if first["rc"] != 0:
        return {**result, "tail": first["tail"]}
    cut = resume_from(runner, full, 10, "in_cut")
    second = runner.accelerate(
        "fsdp_imagenet_resume",
        "scripts/imagenet.py",
        *common,
        "--output-dir",
        cut,
        "--resume-from-checkpoint",
        "latest",
    )
    result["resume"] = {"rc": second["rc"], "resumed": "resumed from" in second["output"], **max_difference(full, cut)}
    if second["rc"] != 0:
        result["resume"]["tail"] = second["tail"]
    import torchvision
    from safetensors.torch import load_file

    torchvision.models.resnet18(num_classes=10).load_state_dict(load_file(str(full / "model.safetensors")), strict=True)
    result["bare_model_loads"] = True
    return result


def probe_workers(agent_pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == agent_pid and "probe.py" in (entry / "cmdline").read_text():
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def check_nccl_restart(runner: Runner) -> dict:
    common = [
        "--batch-size",
        4,
        "--epochs",
        3,
        "--train-size",
        256,
        "--dropout",
        0.3,
        "--checkpointing-steps",
        5,
        "--step-ms",
        20,
    ]
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", 1, "--monitor_interval", 0.2]
    full, faulty = runner.work / "nccl_full", runner.work / "nccl_faulty"
    first = runner.run("nccl_full", [*torchrun, "tests/probe.py", *common, "--output-dir", full], 120)
    result = {"rc_uninterrupted": first["rc"], "backend": banner_value(first["output"], "backend")}
    if first["rc"] != 0:
        return {**result, "tail": first["tail"]}
    log = open(runner.logs / "nccl_faulty.log", "w")
    command = [
        *torchrun,
        "--max_restarts",
        2,
        "tests/probe.py",
        *common,
        "--output-dir",
        faulty,
        "--resume-from-checkpoint",
        "latest",
    ]
    agent = subprocess.Popen(
        [str(c) for c in command],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=runner.env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (faulty / "checkpoints" / "step_10" / "training_state.json").is_file():
        time.sleep(0.05)
    victims = probe_workers(agent.pid)
    killed_at = time.monotonic()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    resumed_after = None
    while time.monotonic() < deadline + 60 and agent.poll() is None:
        if resumed_after is None and "resumed from" in (runner.logs / "nccl_faulty.log").read_text():
            resumed_after = round(time.monotonic() - killed_at, 1)
        time.sleep(0.05)
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
    output = (runner.logs / "nccl_faulty.log").read_text()
    resumed = [line for line in output.splitlines() if "resumed from" in line]
    result.update(
        {
            "killed_workers": len(victims),
            "rc_faulty": agent.returncode,
            "resumed_line": resumed[-1:],
            "kill_to_resumed_s": resumed_after,
            **max_difference(full, faulty),
            **({"tail": output[-1500:]} if agent.returncode != 0 else {}),
        }
    )
    result["preemption"] = check_gpu_preemption(runner, torchrun, common, full)
    # a loss that turns nan on the GPU (the step agreement reads it one step late there) ends the run in one line
    nan = runner.run(
        "nonfinite",
        [PY, "tests/probe.py", "--lr", "1e38", "--train-size", 256, "--output-dir", runner.work / "nan"],
        60,
    )
    errors = [line for line in nan["output"].splitlines() if line.startswith("error:")]
    result["nonfinite"] = {"rc": nan["rc"], "error": errors}
    return result


def check_gpu_preemption(runner: Runner, torchrun: list, common: list, reference: Path) -> dict:
    """SIGUSR1 to the worker mid-epoch: checkpoint of the step reached, exit 0; the rerun ends bitwise equal."""
    out = runner.work / "preempt"
    command = [*torchrun, "tests/probe.py", *common, "--output-dir", out, "--resume-from-checkpoint", "latest"]
    agent = subprocess.Popen(
        [str(c) for c in command],
        stdout=open(runner.logs / "preempt.log", "w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=runner.env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (out / "checkpoints" / "step_10" / "training_state.json").is_file():
        time.sleep(0.05)
    time.sleep(0.3)
    signalled = time.monotonic()
    for pid in probe_workers(agent.pid):
        os.kill(pid, signal.SIGUSR1)
    while time.monotonic() < deadline and not (out / "preempted.json").is_file():
        time.sleep(0.01)
    saved_after = round(time.monotonic() - signalled, 2)
    try:
        code = agent.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(agent.pid)
        code = None
    marker = json.loads((out / "preempted.json").read_text()) if (out / "preempted.json").is_file() else None
    again = runner.run("preempt_resume", command, 120)
    return {
        "rc": code,
        "marker": marker,
        "signal_to_saved_s": saved_after,
        "rc_resume": again["rc"],
        "resumed_line": [line for line in again["output"].splitlines() if "resumed from" in line],
        **max_difference(reference, out),
    }


def make_image_folder(root: Path, classes: int = 6, train: int = 24, val: int = 6) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.fromarray((rng.random((32, 32, 3)) * 60 + c * 35).astype("uint8")).save(folder / f"{i}.png")
    return root


def loss_curve(output_dir: Path) -> list:
    path = output_dir / "history.json"
    return [round(record["train_loss"], 4) for record in json.loads(path.read_text())] if path.is_file() else []


def check_mixed_precision(runner: Runner) -> dict:
    results = {}
    imdb = [
        "scripts/imdb.py",
        "--dataset",
        "synthetic",
        "--epochs",
        3,
        "--batch-size",
        32,
        "--buckets",
        20000,
        "--log-steps",
        10,
    ]
    for model in ("bag", "gcnn"):
        for precision in ("fp16", "bf16"):
            name = f"imdb_{model}_{precision}"
            out = runner.work / name
            extra = ["--checkpointing-steps", 50] if precision == "fp16" else []
            run = runner.run(
                name, [PY, *imdb, "--model", model, "--mixed-precision", precision, *extra, "--output-dir", out]
            )
            m = metrics(out)
            results[name] = {
                "rc": run["rc"],
                "seconds": run["seconds"],
                "train_loss_per_epoch": loss_curve(out),
                "eval_accuracy": m.get("eval_accuracy"),
                "skipped_optimizer_steps": m.get("skipped_optimizer_steps"),
                "samples_per_s": m.get("steady_samples_per_s"),
                **({"tail": run["tail"]} if run["rc"] else {}),
            }
            if precision == "fp16" and run["rc"] == 0:
                import torch

                saved = torch.load(out / "checkpoints" / "step_50" / "scaler.pt", weights_only=False)
                cut = resume_from(runner, out, 50, name + "_cut")
                again = runner.run(
                    name + "_resume",
                    [
                        PY,
                        *imdb,
                        "--model",
                        model,
                        "--mixed-precision",
                        precision,
                        *extra,
                        "--output-dir",
                        cut,
                        "--resume-from-checkpoint",
                        "latest",
                    ],
                )
                line = next((line for line in again["output"].splitlines() if "resumed from" in line), "")
                results[name]["resume"] = {
                    "rc": again["rc"],
                    "saved_scale": saved.get("scale"),
                    "resumed_line": line,
                    **max_difference(out, cut),
                }
    images = make_image_folder(runner.work / "images")
    for precision in ("fp16", "bf16"):
        name, out = f"imagenet_{precision}", runner.work / f"imagenet_{precision}"
        run = runner.run(
            name,
            [
                PY,
                "scripts/imagenet.py",
                images,
                "-a",
                "cifar_resnet20",
                "--image-size",
                32,
                "--augment",
                "cifar",
                "-j",
                2,
                "-b",
                16,
                "-p",
                3,
                "--lr",
                0.05,
                "--epochs",
                6,
                "--channels-last",
                "--mixed-precision",
                precision,
                "--output-dir",
                out,
            ],
        )
        m = metrics(out)
        results[name] = {
            "rc": run["rc"],
            "train_loss_per_epoch": loss_curve(out),
            "best_top1": m.get("best_top1"),
            "skipped_optimizer_steps": m.get("skipped_optimizer_steps"),
            "batches": banner_value(run["output"], "batches"),
            **({"tail": run["tail"]} if run["rc"] else {}),
        }
    return results


def check_scaler_resume(runner: Runner) -> dict:
    """fp16 on a small ResNet, whose first steps overflow: the checkpoint's loss scale is below the initial 65536,
    and the resumed run must start from that scale, not from a fresh scaler."""
    images, full = make_image_folder(runner.work / "scaler_images"), runner.work / "scaler_full"
    common = [
        PY,
        "scripts/imagenet.py",
        images,
        "-a",
        "cifar_resnet20",
        "--image-size",
        32,
        "--augment",
        "cifar",
        "-j",
        2,
        "-b",
        16,
        "-p",
        3,
        "--lr",
        0.05,
        "--epochs",
        3,
        "--mixed-precision",
        "fp16",
        "--checkpointing-steps",
        9,
        "--deterministic",
    ]
    first = runner.run("scaler_full", [*common, "--output-dir", full])
    if first["rc"] != 0:
        return {"rc": first["rc"], "tail": first["tail"]}
    import torch

    saved = torch.load(full / "checkpoints" / "step_18" / "scaler.pt", weights_only=False)
    cut = resume_from(runner, full, 18, "scaler_cut")
    again = runner.run("scaler_resume", [*common, "--output-dir", cut, "--resume-from-checkpoint", "latest"])
    return {
        "rc": again["rc"],
        "saved_scale": saved.get("scale"),
        "skipped_before_checkpoint": saved.get("_growth_tracker"),
        "resumed_line": [line for line in again["output"].splitlines() if "resumed from" in line],
        "skipped_optimizer_steps": metrics(full).get("skipped_optimizer_steps"),
        **max_difference(full, cut),
    }


def check_pipeline(runner: Runner, repeats: int = 2) -> dict:
    runs = []
    for repeat in range(repeats):
        for where in ("loader", "device"):
            if runner.left() < 45:
                break
            out = runner.work / f"r50_{where}_{repeat}"
            run = runner.run(
                f"pipeline_{where}_{repeat}",
                [
                    PY,
                    "scripts/imagenet.py",
                    "--dummy",
                    "-a",
                    "resnet50",
                    "-b",
                    256,
                    "-j",
                    8,
                    "--max-steps",
                    100,
                    "--channels-last",
                    "--mixed-precision",
                    "bf16",
                    "--normalize-on",
                    where,
                    "--output-dir",
                    out,
                    "-p",
                    10,
                ],
                150,
            )
            m = metrics(out)
            runs.append(
                {
                    "normalize_on": where,
                    "rc": run["rc"],
                    "process_s": run["seconds"],
                    "loop_s": m.get("wall_time_s"),
                    "steady_images_per_s": m.get("steady_samples_per_s"),
                    "steady_data_wait_share": m.get("steady_data_wait_share"),
                    "data_wait_share": m.get("data_wait_share"),
                    **({"tail": run["tail"]} if run["rc"] else {}),
                }
            )
    return {"runs": runs}


def check_ray_gpu(runner: Runner) -> dict:
    """One Ray worker on the GPU: SIGKILL it after step 10's checkpoint; the restarted group resumes from it."""
    try:
        import ray
    except ImportError as error:
        return {"skipped": f"Ray is not installed: {error}"}
    common = ["--batch-size", 4, "--epochs", 3, "--train-size", 256, "--dropout", 0.3]
    common += ["--checkpointing-steps", 5, "--step-ms", 20]
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", 1]
    reference = runner.work / "ray_reference"
    first = runner.run("ray_reference", [*torchrun, "tests/probe.py", *common, "--output-dir", reference], 120)
    result = {
        "ray": ray.__version__,
        "rc_torchrun": first["rc"],
        "backend_torchrun": banner_value(first["output"], "backend"),
    }
    if first["rc"] != 0:
        return {**result, "tail": first["tail"]}
    output_dir, pids, log_path = runner.work / "ray_run", runner.work / "ray_pids", runner.logs / "ray_gpu.log"
    home = runner.work / "ray_home"
    home.mkdir()
    env = {**runner.env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    command = [PY, "-m", "ddp_accel", "ray", "--workers", 1, "--gpus-per-worker", 1, "--cpus-per-worker", 2]
    command += ["--max-failures", 2, "tests/probe.py", *common, "--pid-dir", pids, "--output-dir", output_dir]
    started = time.monotonic()
    driver = subprocess.Popen(
        [str(c) for c in command],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    deadline = started + min(200, runner.left())
    step10 = output_dir / "checkpoints" / "step_10" / "training_state.json"
    while time.monotonic() < deadline and driver.poll() is None and not step10.is_file():
        time.sleep(0.05)
    result["first_checkpoint_after_s"] = round(time.monotonic() - started, 1)
    victims = sorted(pids.glob("rank0.*")) if pids.is_dir() else []
    killed_at = time.monotonic()
    for victim in victims:
        os.kill(int(victim.suffix[1:]), signal.SIGKILL)
    resumed_after = None
    while time.monotonic() < deadline and driver.poll() is None:
        if resumed_after is None and "resumed from" in log_path.read_text():
            resumed_after = round(time.monotonic() - killed_at, 1)
        time.sleep(0.05)
    if driver.poll() is None:
        kill_tree(driver.pid)
        driver.wait()
    output = log_path.read_text()
    result.update(
        {
            "rc_ray": driver.returncode,
            "ray_s": round(time.monotonic() - started, 1),
            "killed_worker": [victim.name for victim in victims],
            "worker_starts": len(list(pids.glob("rank*"))) if pids.is_dir() else 0,
            "kill_to_resumed_s": resumed_after,
            "banner": [
                line for line in worker_lines(output) if line.split()[:1] in (["launcher"], ["backend"], ["device"])
            ],
            "resumed_line": [line for line in output.splitlines() if "resumed from" in line][-1:],
            "end_line": [line for line in output.splitlines() if line.startswith("ray: ")][-1:],
            "metrics": {k: metrics(output_dir).get(k) for k in ("end_reason", "launcher", "steps", "world_size")},
        }
    )
    if driver.returncode == 0:
        result.update(max_difference(reference, output_dir))
    else:
        result["tail"] = output[-3000:]
    return result


def worker_lines(output: str) -> list:
    """The lines of Ray's output without the worker's prefix, `(RayTrainWorker pid=N) `."""
    return [re.sub(r"^\x1b\[36m\([^)]*\)\x1b\[0m ", "", line) for line in output.splitlines()]


def capped_memory_run(fraction: float, script: str, *args) -> list:
    """python SCRIPT ARGS with this process's share of the GPU's memory capped: a real out-of-memory error."""
    code = (
        "import runpy, sys, torch; torch.cuda.set_per_process_memory_fraction(float(sys.argv[1])); "
        "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    return [PY, "-c", code, fraction, script, *args]


def check_auto_batch(runner: Runner) -> dict:
    """ResNet-50 asking for 512 images a step in 10% of the card's memory: the largest micro-batch that fits."""
    common = ["--dummy", "-a", "resnet50", "-b", 512, "-j", 8, "--channels-last", "--mixed-precision", "bf16"]
    common += ["--max-steps", 8, "-p", 2, "--dummy-classes", 100]
    result = {}
    for name, fraction, extra in (("capped_auto", 0.1, ["--auto-batch-size"]), ("capped_plain", 0.1, [])):
        out = runner.work / f"auto_batch_{name}"
        run = runner.run(
            f"auto_batch_{name}",
            capped_memory_run(fraction, "scripts/imagenet.py", *common, *extra, "--output-dir", out),
            240,
        )
        m = metrics(out)
        keys = (["batch_size_per_process"], ["gradient_accumulation_steps"], ["global_batch_size"])
        lines = [line.strip() for line in run["output"].splitlines() if line.split()[:1] in keys]
        errors = [line for line in run["output"].splitlines() if line.startswith("error:")]
        result[name] = {
            "rc": run["rc"],
            "seconds": run["seconds"],
            "memory_fraction": fraction,
            "auto_batch_size": m.get("auto_batch_size"),
            "steps": m.get("steps"),
            "end_reason": m.get("end_reason"),
            "steady_images_per_s": m.get("steady_samples_per_s"),
            "lines": lines[:6],
            "errors": errors[:2],
            **({"tail": run["tail"][-800:]} if run["rc"] and not errors else {}),
        }
    return result


def check_compile_gpu(runner: Runner) -> dict:
    """--compile (inductor, default mode) against eager: throughput after warm-up; the weights' names."""
    from safetensors.torch import load_file

    common = ["--dummy", "-a", "resnet50", "-b", 256, "-j", 8, "--channels-last", "--mixed-precision", "bf16"]
    common += ["--max-steps", 100, "-p", 20, "--dummy-classes", 100]
    result = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", "default"])):
        out = runner.work / f"compile_{name}"
        run = runner.run(f"compile_{name}", [PY, "scripts/imagenet.py", *common, *extra, "--output-dir", out], 240)
        m = metrics(out)
        result[name] = {
            "rc": run["rc"],
            "process_s": run["seconds"],
            "loop_s": m.get("wall_time_s"),
            "steady_images_per_s": m.get("steady_samples_per_s"),
            **({"tail": run["tail"][-1200:]} if run["rc"] else {}),
        }
        weights = out / "model.safetensors"
        if name == "compiled" and weights.is_file():
            import torchvision

            keys = list(load_file(str(weights)).keys())
            model = torchvision.models.resnet50(num_classes=100)
            missing = model.load_state_dict(load_file(str(weights)), strict=True)
            result[name]["orig_mod_keys"] = sum("_orig_mod" in key for key in keys)
            result[name]["loads_into_torchvision_resnet50_strict"] = not missing.missing_keys
    return result


CHECKS = {
    "environment": check_environment,
    "fsdp_template": check_fsdp_template,
    "nccl_restart": check_nccl_restart,
    "mixed_precision": check_mixed_precision,
    "fsdp_imagenet": check_fsdp_imagenet,
    "pipeline": check_pipeline,
    "scaler_resume": check_scaler_resume,
    "ray_gpu": check_ray_gpu,
    "auto_batch": check_auto_batch,
    "compile_gpu": check_compile_gpu,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check_results")
    parser.add_argument("--budget-s", type=float, default=330, help="skip what would start after this many seconds")
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run these checks only")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, args.budget_s)
    results_path = out / "gpu_check.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for name in args.only or CHECKS:
        if runner.left() < 20:
            results[name] = {"skipped": "out of time"}
            continue
        started = time.monotonic()
        try:
            results[name] = CHECKS[name](runner)
        except Exception as error:  # a broken check must not lose the others' results
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        results[name]["check_s"] = round(time.monotonic() - started, 1)
        results_path.write_text(json.dumps(results, indent=1, default=str))  # after each check: a timeout loses little
        subprocess.run(["tar", "czf", str(out / "logs.tar.gz"), "-C", str(runner.work), "logs"], check=False)
        print(
            f"== {name} ({results[name]['check_s']} s)\n{json.dumps(results[name], indent=1, default=str)[:3000]}",
            flush=True,
        )
    shutil.rmtree(runner.work, ignore_errors=True)


if __name__ == "__main__":
    main()
