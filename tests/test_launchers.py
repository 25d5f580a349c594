"""Every way to launch gives the same run: accelerate launch, torchrun (= python -m torch.distributed.run),
torch.distributed.launch, notebook_launcher and debug_launcher (bitwise equal final weights), and the notebook in a
real kernel."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, check_ok, free_port, launch, metrics_of, weights

ARGS = ["--batch-size", "4", "--epochs", "2", "--dropout", "0.3", "--train-size", "48"]


def run_with(launcher: str, output_dir) -> str:
    args = [*ARGS, "--output-dir", str(output_dir)]
    env = {"OMP_NUM_THREADS": "1"}
    if launcher in ("accelerate", "torchrun"):
        return check_ok(launch("tests/probe.py", *args, launcher=launcher))
    if launcher in ("torch.distributed.run", "torch.distributed.launch"):  # launch: legacy, passes --local-rank
        command = [
            sys.executable,
            "-m",
            launcher,
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "tests/probe.py",
            *args,
        ]
    else:  # notebook / debug
        command = [sys.executable, "tests/launcher_driver.py", launcher, *args]
    return check_ok(
        subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **env})
    )


@pytest.mark.multiprocess
def test_all_launchers_give_bitwise_identical_weights(tmp_path):
    # (`python -m torch.distributed.run` is torchrun's own entry point: torchrun stands for it)
    launchers = ["accelerate", "torchrun", "torch.distributed.launch", "notebook", "debug"]
    for launcher in launchers:
        run_with(launcher, tmp_path / launcher)
        metrics = metrics_of(tmp_path / launcher)
        assert metrics["world_size"] == 2 and metrics["distributed_type"] == "MULTI_CPU", launcher
    reference = weights(tmp_path / "accelerate")
    for launcher in launchers[1:]:
        other = weights(tmp_path / launcher)
        assert all(torch.equal(reference[key], other[key]) for key in reference), f"{launcher} differs"


@pytest.mark.multiprocess
def test_notebook_runs_two_processes_in_a_real_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    shutil.copy(ROOT / "scripts" / "notebook_launcher.ipynb", tmp_path)
    notebook = nbformat.read(tmp_path / "notebook_launcher.ipynb", as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = "\n".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "world size 2 (MULTI_CPU), eval accuracy 1.000 on 200 samples" in text, text[-2000:]
    # (accelerate's own line says "Launching training on 2 CUDAs" with a CUDA build of torch even without a
    # GPU; the metrics above are what the processes really ran on)
    assert "Launching training on 2" in text
