"""`ddp-accel doctor`: check the machines before the first training step, under the launcher you train with.

    torchrun --nproc_per_node 2 -m ddp_accel doctor --output-dir OUTPUT_DIR
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank 0 -m ddp_accel doctor

Every process checks what it can alone (the rendezvous address resolves and answers, the address its backend will
use), then joins the group with a short timeout and measures an all-reduce of a small tensor (latency) and of a
large one (bandwidth). Rank 0 then compares what every process reports: the versions of Python, torch, accelerate
and ddp_accel, whether the output dir is the same folder on every machine (checkpoints need that), free disk, the
clocks, and with `--data PATH` the data each machine has there. One line per problem, naming the host and what to
set; a table when all is well. Exit status 0 when all is well, 1 when a problem was found.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_accel.identity import file_sha256

CLOCK_SKEW_S = 2.0
LOW_DISK_GB = 5.0  # the default of --min-free-gb: a few checkpoints of a large model


@dataclass
class Report:
    """What one process found."""

    rank: int
    host: str
    local_rank: int = 0
    address: str = "?"
    interface: str = "?"
    versions: dict[str, str] = field(default_factory=dict)
    free_gb: float | None = None
    sees_output_dir: bool | None = None
    cannot_write: str | None = None  # rank 0: why --output-dir could not take its marker (a file there, read-only)
    clock: float = 0.0
    latency_ms: float | None = None
    bandwidth_mb_s: float | None = None
    data: str | None = None  # data_fingerprint of --data on this machine


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("accelerate", "ddp-accel"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def data_fingerprint(path: str) -> str:
    """What this machine has at `path`, comparable between copies: a folder by its files' relative paths and
    sizes (not their times, which differ between copies), a file by its content."""
    root = Path(path)
    if root.is_file():
        return f"file of {root.stat().st_size:,} bytes, sha256 {file_sha256(root)[:16]}"
    if not root.is_dir():
        return "missing"
    files = sorted((str(item.relative_to(root)), item.stat().st_size) for item in root.rglob("*") if item.is_file())
    digest = hashlib.sha256()
    for name, size in files:
        digest.update(f"{name}\0{size}\n".encode())
    return f"{len(files):,} files, {sum(size for _, size in files):,} bytes, listing {digest.hexdigest()[:16]}"


def route_to(address: str, port: int) -> tuple[str, str]:
    """(local address, interface) this host uses to reach `address`: what gloo listens on when the host name does
    not say otherwise."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, port))  # UDP: no packet is sent, the kernel only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return "?", "?"
    try:
        listing = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5)
        for line in listing.stdout.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[3].split("/")[0] == local:
                return local, parts[1]
    except (OSError, subprocess.SubprocessError):
        pass
    return local, "?"


def loopback_problem(
    host: str, host_address: str, multi_node: bool, ifname: str | None, route: tuple[str, str]
) -> str | None:
    """gloo listens on the address the host name resolves to: on a loopback address the other machines cannot
    reach it, and the group never forms (it waits for the rendezvous timeout)."""
    if not multi_node or ifname or not host_address.startswith("127."):
        return None
    interface = route[1] if route[1] not in ("?", "lo") else "the interface that reaches the other machines"
    return (
        f"host {host}: its name resolves to {host_address} (loopback): gloo would listen there and the other machines "
        f"could not reach it; set GLOO_SOCKET_IFNAME={interface} on every machine (or fix /etc/hosts)"
    )


def precheck(env: dict[str, str], host: str, timeout_s: float) -> list[str]:
    """What one process can find before the group forms."""
    problems: list[str] = []
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    address, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
    try:
        resolved = str(socket.getaddrinfo(address, port, socket.AF_INET)[0][4][0])
    except (OSError, IndexError):
        return [f"host {host}, rank {rank}: MASTER_ADDR={address} does not resolve; give the first machine's address"]
    multi_node = int(env.get("LOCAL_WORLD_SIZE", str(world))) < world
    if multi_node and resolved.startswith("127."):
        return [
            f"host {host}, rank {rank}: MASTER_ADDR={address} is a loopback address ({resolved}), but the job spans "
            "machines: give the first machine's network address (--main_process_ip, --master_addr)"
        ]
    try:
        host_address = socket.gethostbyname(socket.gethostname())
    except OSError:
        host_address = "?"
    problem = loopback_problem(host, host_address, multi_node, env.get("GLOO_SOCKET_IFNAME"), route_to(address, port))
    if problem:  # this machine's own: said before, and without, waiting for the first machine (which may have
        # stopped at its own problem already: a refused connection would only add a second line)
        return [problem]
    if world > 1 and rank != 0:
        deadline, last_error = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((address, port), timeout=min(5.0, timeout_s)):
                    last_error = ""
                    break
            except OSError as error:
                last_error = error.strerror or type(error).__name__
                time.sleep(0.5)
        if last_error:
            problems.append(
                f"host {host}, rank {rank}: nothing answers at MASTER_ADDR={address} MASTER_PORT={port} "
                f"({last_error}) within {timeout_s:.0f} s: is the first machine started, is it that address, is the "
                "port open in its firewall?"
            )
    return problems


def measure(report: Report, megabytes: int) -> None:
    small, large = torch.zeros(1), torch.zeros(megabytes * 2**20 // 4)
    dist.all_reduce(small)  # warm-up: the connections form
    started = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(small)
    report.latency_ms = (time.perf_counter() - started) / 20 * 1000
    dist.all_reduce(large)
    started = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(large)
    report.bandwidth_mb_s = 3 * megabytes / (time.perf_counter() - started)


def write_marker(marker: Path, host: str) -> str | None:
    """Rank 0's marker in --output-dir, which the others look for; why it could not be written, or None."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(host)
    except OSError as error:
        in_the_way = next((parent for parent in marker.parents if parent.is_file()), None)
        why = f"{in_the_way} is a file" if in_the_way is not None else (error.strerror or type(error).__name__)
        return f"cannot write under it ({why})"
    return None


def compare(
    reports: list[Report], output_dir: str | None, data: str | None = None, min_free_gb: float = LOW_DISK_GB
) -> list[str]:
    """Rank 0's view: what differs between the processes."""
    problems = []
    reference = reports[0]
    for report in reports:
        if data is not None and report.data != reference.data:
            problems.append(
                f"host {report.host}, rank {report.rank}: --data {data} is {report.data} there, {reference.data} on "
                f"rank 0 ({reference.host}): copy the same data to every machine"
            )
        elif data is not None and report.data == "missing":
            problems.append(f"host {report.host}, rank {report.rank}: --data {data} does not exist there")
    for report in reports[1:]:
        differs = {k: v for k, v in report.versions.items() if reference.versions.get(k) != v}
        if differs:
            theirs = ", ".join(f"{k} {v}" for k, v in differs.items())
            ours = ", ".join(f"{k} {reference.versions.get(k)}" for k in differs)
            problems.append(
                f"host {report.host}, rank {report.rank}: {theirs}, where rank 0 ({reference.host}) has {ours}"
            )
    if output_dir is not None and reference.cannot_write:
        problems.append(
            f"host {reference.host}: --output-dir {output_dir}: {reference.cannot_write}; give a writable folder "
            "every machine sees"
        )
    elif output_dir is not None:
        for report in reports:
            if report.sees_output_dir is False:
                problems.append(
                    f"host {report.host}, rank {report.rank}: --output-dir {output_dir} is not the folder rank 0 "
                    f"({reference.host}) writes to: checkpoints need a folder every machine sees (a shared filesystem)"
                )
            if report.free_gb is not None and report.free_gb < min_free_gb:
                problems.append(f"host {report.host}: {report.free_gb:.1f} GB free under --output-dir {output_dir}")
    clocks = [report.clock for report in reports]
    if max(clocks) - min(clocks) > CLOCK_SKEW_S:
        late = max(reports, key=lambda report: abs(report.clock - reference.clock))
        problems.append(
            f"host {late.host}: its clock is {late.clock - reference.clock:+.1f} s from rank 0's ({reference.host}); "
            "run NTP (chrony) on every machine: logs and timeouts compare times"
        )
    return list(dict.fromkeys(problems))


def table(reports: list[Report]) -> str:
    rows = [("rank", "host", "address", "interface", "latency ms", "bandwidth MB/s", "free GB", "torch", "ddp-accel")]
    for r in reports:
        rows.append(
            (
                str(r.rank),
                r.host,
                r.address,
                r.interface,
                f"{r.latency_ms:.2f}" if r.latency_ms is not None else "-",
                f"{r.bandwidth_mb_s:.0f}" if r.bandwidth_mb_s is not None else "-",
                f"{r.free_gb:.0f}" if r.free_gb is not None else "-",
                r.versions.get("torch", "?"),
                r.versions.get("ddp-accel", "?"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def run(
    output_dir: str | None, timeout_s: float, megabytes: int, data: str | None = None, min_free_gb: float = LOW_DISK_GB
) -> int:
    env, host = dict(os.environ), socket.gethostname()
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    problems = precheck(env, host, timeout_s)
    if problems:
        for line in problems:
            print(f"doctor: {line}", file=sys.stderr, flush=True)
        return 1
    report = Report(rank=rank, host=host, local_rank=int(env.get("LOCAL_RANK", "0")), versions=versions())
    report.data = data_fingerprint(data) if data else None
    report.address, report.interface = route_to(
        env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
    )
    token = form_group(report, world, timeout_s, megabytes) if world > 1 else secrets.token_hex(8)
    if token is None:
        return 1
    marker = Path(output_dir) / f".doctor_{token}" if output_dir else None
    if marker is not None:
        if rank == 0:
            report.cannot_write = write_marker(marker, host)
        if world > 1:
            dist.barrier()
        report.sees_output_dir = marker.is_file()
        report.free_gb = shutil.disk_usage(marker.parent if marker.parent.exists() else ".").free / 2**30
    if world > 1:
        dist.barrier()
    report.clock = time.time()
    gathered: list[dict] = [asdict(report)]
    if world > 1:
        gathered = [{} for _ in range(world)]
        dist.all_gather_object(gathered, asdict(report))
        dist.barrier()  # every rank has looked at the marker
    reports = sorted((Report(**item) for item in gathered), key=lambda item: item.rank)
    if marker is not None and rank == 0 and report.cannot_write is None:
        with contextlib.suppress(OSError):
            marker.unlink(missing_ok=True)
    problems = compare(reports, output_dir, data, min_free_gb)
    if rank == 0:
        say(reports, problems)
    if world > 1:
        dist.destroy_process_group()
    return 1 if problems else 0


def form_group(report: Report, world: int, timeout_s: float, megabytes: int) -> str | None:
    """Join the `world` processes, measure the all-reduce into `report`, and return rank 0's token (the name of the
    shared output dir's marker, the same on every rank); None, with the line said, when the group does not form."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # a timeout, a refused connection: one line, not a traceback
        print(
            f"doctor: host {report.host}, rank {report.rank}: the group of {world} processes did not form within "
            f"{timeout_s:.0f} s ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})",
            file=sys.stderr,
            flush=True,
        )
        return None
    measure(report, megabytes)
    token_holder = [secrets.token_hex(8)]
    dist.broadcast_object_list(token_holder, src=0)
    return token_holder[0]


def say(reports: list[Report], problems: list[str]) -> None:
    """Rank 0's verdict: one line per problem, else the table and one line."""
    for line in problems:
        print(f"doctor: {line}", file=sys.stderr, flush=True)
    if not problems:
        print(table(reports))
        machines = len({(r.host, r.address) for r in reports})
        print(f"doctor: all is well: {len(reports)} process(es) on {machines} machine(s)")
