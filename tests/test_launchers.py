"""Every way to launch gives the same run: accelerate launch, torchrun (= python -m torch.distributed.run),
torch.distributed.launch, notebook_launcher and debug_launcher (bitwise equal final weights), and the notebook in a
real kernel."""

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, SHORT_PROBE_ARGS, check_ok, free_port, launch, metrics_of, torch_elastic_worker, weights

from ddp_accel import launched
from ddp_accel.notebook import wait_for_the_other_forks

ARGS = SHORT_PROBE_ARGS  # conftest's `short_job` is its run under accelerate launch


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
def test_all_launchers_give_bitwise_identical_weights(tmp_path, short_job):
    # (`python -m torch.distributed.run` is torchrun's own entry point: torchrun stands for it)
    launchers = ["accelerate", "torchrun", "torch.distributed.launch", "notebook", "debug"]
    for launcher in launchers[1:]:
        run_with(launcher, tmp_path / launcher)
    for launcher in launchers:
        metrics = metrics_of(short_job if launcher == "accelerate" else tmp_path / launcher)
        assert metrics["world_size"] == 2 and metrics["distributed_type"] == "MULTI_CPU", launcher
    for launcher in ("accelerate", "torchrun", "torch.distributed.launch"):  # torch elastic's agent
        folder = short_job if launcher == "accelerate" else tmp_path / launcher
        for rank in (
            0,
            1,
        ):  # each worker's error file is ATTEMPT/LOCAL_RANK/error.json (launch_environments.peer_failed)
            layout = json.loads((folder / f"error_files_rank{rank}.json").read_text())
            assert layout["own"] == str(rank) and {"0", "1"} <= set(layout["workers"]), (launcher, layout)
    reference = weights(short_job)  # accelerate launch's
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


KERNEL_SETUP = """
import time
from accelerate import notebook_launcher
from ddp_accel import RunRecord, Task, TrainConfig, fit, launched, make_accelerator

@launched
def training_function(output_dir, epochs, resume=None, step_s=0.0):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    config = TrainConfig(output_dir=output_dir, epochs=epochs, batch_size=16, seed=0, resume_from_checkpoint=resume)
    accelerator = make_accelerator(config)
    data = TensorDataset(torch.randn(400, 16), torch.randint(0, 3, (400,)))
    model = torch.nn.Linear(16, 3)
    def loss_fn(model, batch):
        time.sleep(step_s)
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    task = Task(model, torch.optim.SGD(model.parameters(), lr=0.05), DataLoader(data, batch_size=16), loss_fn)
    fit(accelerator, config, task, RunRecord(title="kernel"))
"""


class Kernel:
    """A real Jupyter kernel: run a cell, optionally interrupt it (what the notebook's stop button does)."""

    def __init__(self, cwd):
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(cwd))

    def run(self, code: str, interrupt_after: float | None = None, timeout: float = 120) -> tuple[str, list[str]]:
        import queue
        import threading

        msg_id = self.client.execute(code)
        if interrupt_after is not None:
            threading.Timer(interrupt_after, self.manager.interrupt_kernel).start()
        text, errors = [], []
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                return "".join(text), [*errors, "TIMEOUT"]
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            content = msg["content"]
            if msg["msg_type"] == "stream":
                text.append(content["text"])
            elif msg["msg_type"] == "error":
                errors.append(f"{content['ename']}: {content['evalue']}")
            elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
                return "".join(text), errors

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.mark.multiprocess
def test_notebook_launches_after_an_interrupted_and_a_failed_one_and_a_kernel_process_group(tmp_path):
    # the kernel keeps its earlier launches' store: a launch after an interrupted or failed one read their gloo
    # addresses (`Gloo connectFullMesh failed ... Connection refused` after 30 s, every later launch); a process
    # group made in the kernel aborted the workers (`terminate called ... std::system_error`, SIGABRT)
    pytest.importorskip("jupyter_client")
    kernel = Kernel(ROOT)
    try:
        _, errors = kernel.run(KERNEL_SETUP)
        assert not errors, errors

        def launch(name, *args, interrupt_after=None):
            return kernel.run(
                f"notebook_launcher(training_function, args=({str(tmp_path / name)!r}, {', '.join(map(repr, args))}),"
                " num_processes=2)",
                interrupt_after=interrupt_after,
            )

        _, errors = launch("interrupted", 50, None, 0.05, interrupt_after=1.0)  # stopped while it starts
        assert errors and "TIMEOUT" not in errors, errors
        _, errors = launch("failed", 1, "/nonexistent")  # a user error in every worker
        assert errors and "TIMEOUT" not in errors, errors
        for run in range(3):
            text, errors = launch(f"run{run}", 1)
            assert not errors and "done: 13 steps" in text, (errors, text[-2000:])
        init = "import torch.distributed as dist; dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{}', "
        assert not kernel.run(init.format(free_port()) + "rank=0, world_size=1)")[1]
        text, errors = launch("inherited", 1)
        assert errors and "terminate called" not in text, (errors, text[-2000:])
        assert "torch.distributed was initialised in the notebook's kernel" in text, text[-3000:]
    finally:
        kernel.close()


def _first_worker(returned) -> None:
    # what notebook_launcher's agent sets for the first of 2 workers it forks
    os.environ.update(TORCHELASTIC_RUN_ID="none", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    returned.value = launched(time.monotonic)()


@pytest.mark.multiprocess
def test_a_forked_worker_starts_only_once_its_launcher_has_forked_the_other():
    # notebook_launcher forks the workers from the kernel, whose store server thread looks up the name of every
    # worker that connects (glibc's resolver lock held): a worker forked meanwhile hung at its first lookup (CI,
    # 2026-11-28, `gethostbyaddr_r -> __lll_lock_wait_private` in the second worker). So no worker may connect
    # before the last fork: the first one waits for its sibling, and an earlier child of the kernel is no sibling.
    fork = multiprocessing.get_context("fork")
    earlier_child = fork.Process(target=time.sleep, args=(10,))
    earlier_child.start()
    time.sleep(0.2)
    returned = fork.Value("d", 0.0)
    first = fork.Process(target=_first_worker, args=(returned,))
    first.start()
    time.sleep(1.0)
    second_forked_at = time.monotonic()
    second = fork.Process(target=time.sleep, args=(5,))
    second.start()
    first.join(30)
    for child in (second, earlier_child):
        child.kill()
        child.join()
    assert first.exitcode == 0 and returned.value >= second_forked_at, (returned.value, second_forked_at)
    assert returned.value - second_forked_at < 3, "it waited on after the second fork"
    # this pytest process is not a fork of its parent (a shell, CI's runner): nothing to wait for
    started = time.monotonic()
    assert not wait_for_the_other_forks(0, 2, timeout_s=30) and time.monotonic() - started < 1


FORK_WITH_A_STOP_SIGNAL = """
import os, signal, time
# registered before ddp_accel's hooks, so it runs inside them: a stop signal that arrives while the fork runs
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGINT))
from ddp_accel.notebook import launched
launched(print)  # the kernel's training function, wrapped: the hooks are registered
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
signal.signal(signal.SIGINT, _terminate_process_handler)  # what torch elastic's agent installs before it forks
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(10)
    print("not stopped")
except SignalException as error:
    print("stopped:", error)
"""


@pytest.mark.multiprocess
def test_a_stop_signal_that_arrives_while_the_agent_forks_a_worker_still_stops_it():
    # the stop button pressed while notebook_launcher's agent forked a worker: torch's handler raised inside an
    # at-fork hook (logging's), where CPython prints the exception as "ignored" and drops it; the training ran on
    result = subprocess.run(
        [sys.executable, "-c", FORK_WITH_A_STOP_SIGNAL], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.stdout.startswith("stopped: "), (result.stdout, result.stderr[-2000:])
    assert "Exception ignored" not in result.stderr, result.stderr[-2000:]


@pytest.mark.multiprocess
def test_the_start_up_guard_imports_nothing_heavy_and_writes_the_marker_at_once(tmp_path):
    # a signal during a script's imports: the marker and exit 0, from a module that costs no torch import
    import subprocess
    import sys

    from ddp_accel.startup import output_dir_of

    assert output_dir_of(["--output-dir", "a", "--output_dir=b"], "d") == "b" and output_dir_of([], "d") == "d"
    code = (
        "import sys; from ddp_accel.startup import stop_during_imports; assert 'torch' not in sys.modules; "
        "stop_during_imports('unused'); import os, signal, time; os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "preempted by SIGTERM before training started" in result.stderr, result
    facts = json.loads((tmp_path / "out" / "preempted.json").read_text())
    assert (facts["phase"], facts["signal"], facts["step"], facts["moment"]) == ("startup", "SIGTERM", None, "imports")
    # under torch elastic, after another worker of the attempt wrote its error file: the agent ending the group,
    # not a preemption (a marker would have a job script requeue a bad option): no marker, no line, a signal's code
    elastic = torch_elastic_worker(tmp_path, local_rank=1)
    peer_error = Path(elastic["TORCHELASTIC_ERROR_FILE"]).parent.parent / "0" / "error.json"
    peer_error.write_text('{"message": "error: --sparse on: only --model bag"}')
    result = subprocess.run(
        [sys.executable, "-c", code, "--output-dir", str(tmp_path / "ended")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **elastic},
    )
    assert result.returncode == 128 + signal.SIGTERM and result.stderr == "", result
    assert not (tmp_path / "ended").exists()
