import os
import socket
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MULTI_GPU_YAML = ROOT / "accelerate_configs" / "multi_gpu.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script, *args, nproc: int = 2, launcher: str = "accelerate", timeout: int = 300, env=None):
    """Run a script the way a user would: under accelerate launch / torchrun with nproc processes, or plain python."""
    script = str(ROOT / script) if not os.path.isabs(str(script)) else str(script)
    args = [str(arg) for arg in args]
    if launcher == "accelerate":
        command = [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(MULTI_GPU_YAML),
            "--num_processes",
            str(nproc),
            "--main_process_port",
            str(free_port()),
            script,
            *args,
        ]
    elif launcher == "torchrun":
        command = [
            str(BIN / "torchrun"),
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            script,
            *args,
        ]
    elif launcher == "python":
        command = [sys.executable, script, *args]
    else:
        raise ValueError(launcher)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env)


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


def check_ok(result) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}\n{output[-4000:]}"
    assert "terminate called" not in output, output[-4000:]
    return output


def weights(output_dir) -> dict:
    return load_file(str(Path(output_dir) / "model.safetensors"))


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
