"""The torchelastic + etcd recipe for real: a private etcd (v2 API) on a free loopback port, 2 nodes joining
through `torchrun --rdzv_backend etcd-v2`. Skips when the etcd binary or python-etcd is missing (.ci/run
installs Debian's etcd-server and PyPI's python-etcd)."""

import re
import shutil
import subprocess
import time
import urllib.request

import pytest
from conftest import BIN, free_port, start_node, wait_nodes

ETCD = shutil.which("etcd")


@pytest.fixture
def etcd_endpoint(tmp_path):
    if ETCD is None:
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    pytest.importorskip("etcd", reason="python-etcd is not installed")
    client, peer = free_port(), free_port()
    server = subprocess.Popen(
        [
            ETCD,
            "--enable-v2",
            "--name",
            "test",
            "--data-dir",
            str(tmp_path / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{client}/version", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError("etcd did not start") from None
                time.sleep(0.2)
        yield f"127.0.0.1:{client}"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.system
def test_two_nodes_rendezvous_through_etcd(tmp_path, etcd_endpoint):
    command = [
        str(BIN / "torchrun"),
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "etcd-v2",
        "--rdzv_endpoint",
        etcd_endpoint,
        "--rdzv_id",
        "ddp-accel-test",
        "scripts/minimal.py",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    outputs = wait_nodes([start_node(command) for _ in range(2)])
    ranks = sorted(
        int(rank) for out in outputs for rank in re.findall(r"^rank (\d+) local_rank 0 world_size 2", out, re.M)
    )
    assert ranks == [0, 1], outputs
