"""Helpers the tests share: run a script in this process or under a launcher, wait for a process or a checkpoint,
read what a run left (weights, metrics), and check a user error is one clean line."""

import contextlib
import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MULTI_GPU_YAML = ROOT / "accelerate_configs" / "multi_gpu.yaml"
# the probe's standard job, which the fault, Ray, Kubernetes and two-machine tests stop, kill or cut: 256 samples,
# 2 ranks x batch 4 (32 steps an epoch), 3 epochs, a checkpoint every 5 steps, dropout on (an exact resume also needs
# every rank's RNG state). Each compares its end with one uninterrupted run of it (conftest's `standard_reference`):
# --step-ms (a sleep per step) and --timeout-s (a bound on waits) change no weight, and every 2-process launcher
# gives bitwise the same weights (test_launchers.py)
STANDARD_PROBE_ARGS = ["--batch-size", "4", "--epochs", "3", "--train-size", "256", "--dropout", "0.3"]
STANDARD_PROBE_ARGS += ["--checkpointing-steps", "5"]
# a short 2-process job with dropout and a checkpoint every 5 steps: 96 samples, 2 ranks x batch 4 (12 steps an
# epoch), 2 epochs. Its run under accelerate launch (conftest's `short_job`) is read by the test of every launcher,
# of asynchronous checkpoints and of a mid-epoch resume
SHORT_PROBE_ARGS = ["--batch-size", "4", "--train-size", "96", "--val-size", "23", "--epochs", "2", "--dropout", "0.3"]
SHORT_PROBE_ARGS += ["--checkpointing-steps", "5", "--mixed-precision", "no"]


def torch_elastic_worker(folder: Path, local_rank: int) -> dict[str, str]:
    """torch elastic's variables for worker `local_rank` of a 2-worker attempt, with the agent's per-worker folders
    for their error files (FOLDER/torchelastic/attempt_0/R/error.json), as launch_environments.TorchElastic.peer_failed
    reads them."""
    attempt = folder / "torchelastic" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True, exist_ok=True)
    return {
        "TORCHELASTIC_RUN_ID": "job",
        "WORLD_SIZE": "2",
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "TORCHELASTIC_ERROR_FILE": str(attempt / str(local_rank) / "error.json"),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script, *args, nproc: int = 2, launcher: str = "accelerate", timeout: int = 300, env=None, config=None):
    """Run a script the way a user would: under accelerate launch (multi_gpu.yaml, or `config`) / torchrun with
    nproc processes, or plain python."""
    script = str(ROOT / script) if not os.path.isabs(str(script)) else str(script)
    args = [str(arg) for arg in args]
    if launcher == "accelerate":
        command = [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(config or MULTI_GPU_YAML),
            "--num_processes",
            str(nproc),
            "--main_process_port",
            str(free_port()),
            script,
            *args,
        ]
    elif launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
        command += [script, *args]
    elif launcher == "python":
        command = [sys.executable, script, *args]
    else:
        raise ValueError(launcher)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("WORLD_SIZE", None)
    # a session of its own: when the command returns, nothing of it may be left (ranks, workers, forkservers)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=full_env,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        raise
    assert_nothing_left(process.pid, command)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def session_members(session: int) -> dict[int, str]:
    """pid -> command line of every process of `session` that is still running (a zombie, dead and waiting for its
    parent, or for the init that adopted it, to reap it, is not)."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session and fields[0] != "Z":  # the state, the parent, the process group, session
                members[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # it ended while we read
    return members


def helper_process(command: str) -> int | None:
    """The pid of this process's child that runs Python's `-c` helper `command` (the forkserver, the resource
    tracker), or None."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if command in " ".join(child.cmdline()):
                return child.pid
    return None


def assert_nothing_left(session: int, command: list[str], grace_s: float = 3.0) -> None:
    """The command returned: no process of its session may still run a moment later (multiprocessing's resource
    tracker ends by itself once the command's processes are gone)."""
    deadline = time.monotonic() + grace_s
    left = session_members(session)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = session_members(session)
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session, signal.SIGKILL)
        raise AssertionError(f"{' '.join(command[:3])}... returned with processes of its own still there: {left}")


@dataclass
class Result:
    """What a script run in-process left: its exit code and output (the fields of subprocess.CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


_SCRIPTS: dict[str, object] = {}


def load_script(script: str):
    """scripts/x.py or tests/x.py as a module (imported once per session)."""
    if script not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(Path(script).stem + "_under_test", ROOT / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPTS[script] = module
    return _SCRIPTS[script]


def run_script(script: str, *args, env: dict | None = None, curves: bool = False) -> Result:
    """Run a script's main() through run_main inside this process, as `python script args` would: its exit code and
    what it printed. No interpreter start and no imports: an error path costs milliseconds, a small training seconds.

    training_curves.png is drawn only with `curves=True` (DDP_ACCEL_CURVES, as the suite's launched runs: see
    conftest.py); the plot is proven by its own test (test_pieces) and the runs that ask for it."""
    from accelerate.state import AcceleratorState

    from ddp_accel import run_main
    from ddp_accel.plots import CURVES_VARIABLE

    module = load_script(script)
    stdout, stderr = io.StringIO(), io.StringIO()
    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = [str(ROOT / script), *map(str, args)]
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(name, None)
    os.environ[CURVES_VARIABLE] = "1" if curves else "0"
    os.environ.update(env or {})
    code = 0
    try:  # (the session keeps its forkserver: conftest.py)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            run_main(module.main)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own Accelerator
    return Result(code, stdout.getvalue(), stderr.getvalue())


def start_node(command: list[str]) -> subprocess.Popen:
    """One launcher process of a multi-node job (each "machine" is a process on this host)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)


def wait_nodes(nodes: list[subprocess.Popen], timeout: int = 240) -> list[str]:
    """Outputs of every node; each must exit 0 (a node still running after `timeout` is killed)."""
    outputs = []
    for node in nodes:
        try:
            out, _ = node.communicate(timeout=timeout)
        finally:
            if node.poll() is None:
                node.kill()
        assert node.returncode == 0, out[-3000:]
        assert "terminate called" not in out, out[-3000:]
        outputs.append(out)
    return outputs


def wait_for(condition, timeout: float = 120, interval: float = 0.05, alive=None, what: str = "a condition"):
    """Poll `condition` until it returns something true (returned); fail after `timeout` or once `alive` (a
    Popen) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the process ended (exit {alive.returncode}) before {what}")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def checkpoint_steps(output_dir: Path) -> list[int]:
    root = Path(output_dir) / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "training_state.json").is_file())


def wait_for_checkpoint(output_dir: Path, step: int, timeout: float = 120, alive=None) -> None:
    """Wait until checkpoints/step_{step} is complete."""
    wait_for(
        lambda: (Path(output_dir) / "checkpoints" / f"step_{step}" / "training_state.json").is_file(),
        timeout,
        alive=alive,
        what=f"the checkpoint of step {step} in {output_dir}",
    )


def parents() -> dict[int, int]:
    """Every process's parent (pid -> ppid), from /proc/*/stat (the field after the command, which may hold spaces
    and parentheses)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (ranks, DataLoader workers)."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def workers(agent: subprocess.Popen) -> list[int]:
    """PIDs of the probe processes a torchrun agent started (its children)."""
    found = []
    for pid, parent in parents().items():
        with contextlib.suppress(OSError):
            if parent == agent.pid and "probe.py" in Path(f"/proc/{pid}/cmdline").read_text():
                found.append(pid)
    return sorted(found)


def rank_of(pid: int) -> int:
    """The RANK torchrun gave a worker process."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(entry for entry in environ if entry.startswith(b"RANK=")).split(b"=")[1])


def kill_tree(process: subprocess.Popen) -> None:
    """A process started with start_new_session=True, and everything in its session."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def check_ok(result) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}\n{output[-4000:]}"
    assert "terminate called" not in output, output[-4000:]
    return output


def weights(output_dir) -> dict:
    return load_file(str(Path(output_dir) / "model.safetensors"))


def assert_same_weights(dir_a, dir_b, atol: float | None = None) -> None:
    """The model.safetensors of two output dirs: bitwise equal, or within `atol` (and a relative 1e-5)."""
    a, b = weights(dir_a), weights(dir_b)
    assert a.keys() == b.keys()
    for key in a:
        if atol is None:
            assert torch.equal(a[key], b[key]), f"{key} differs"
        else:
            torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-5, msg=f"{key} differs")


def metrics_of(output_dir) -> dict:
    """metrics.json of a run."""
    return json.loads((Path(output_dir) / "metrics.json").read_text())


def assert_clean_error(result, *fragments: str) -> str:
    """A user error: exit 2, no traceback, exactly one `error:` line holding every fragment. Returns that line."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    # ours: "error: ..."; argparse's (a bad option): "script.py: error: ..."
    errors = [line for line in output.splitlines() if line.startswith("error: ") or ": error: " in line]
    assert len(errors) == 1, output[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def write(path: Path, text: str | bytes) -> Path:
    """A file with this content (text as UTF-8); returns its path."""
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes): what a failed command must leave unchanged."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
