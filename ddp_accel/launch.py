"""`ddp-accel launch ...`: `accelerate launch` with the same arguments, whose wait for the other machines speaks,
ends at a bound and stops on Ctrl-C.

    ddp-accel launch --config_file accelerate_configs/multi_node.yaml --machine_rank 1 scripts/imdb.py

Until every machine has joined, a multi-machine launch waits inside torch's elastic agent, before any line of the
training script runs: in silence, for up to 15 minutes (torch's rendezvous timeout), and a Ctrl-C is not acted on
there. This runs `accelerate launch` as a child and, until the training processes start:

- refuses a machine rank or process count the config cannot form a group with (one line, exit 2, on the machine
  that has it: every machine checks its own command);
- says within seconds, then every `--wait-report-s`, what it waits for: the address and port, and what it sees
  there (machine 0: the other machines connected to its port so far; another machine: whether machine 0 answers);
- ends after `--join-timeout-s` with one line naming what is missing (exit 1), and at once on Ctrl-C or SIGTERM
  (exit 130 / 143), the launcher and everything it started stopped by its process group.

Once the training processes run, signals are passed to the launcher (a preemption signal saves the step reached,
as with `accelerate launch`) and its exit status is this command's.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from ddp_accel import recovery
from ddp_accel.cli import ArgumentParser, positive, positive_int
from ddp_accel.elastic import child_processes
from ddp_accel.errors import UserError
from ddp_accel.launch_environments import answers

DEFAULT_PORT = 29500
PARALLELISM = "ACCELERATE_USE_PARALLELISM_CONFIG"  # (accelerate launch's word to its processes: a parallelism_config)


def machine_setup(accelerate_args: list[str]) -> dict[str, Any]:
    """What `accelerate launch` would use: the command's flags over the config file's values."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    from ddp_accel.accelerate_config import check_config
    from ddp_accel.config_file import file_accelerate_launch_reads

    args = launch_command_parser().parse_args(accelerate_args)  # argparse's own one line for a bad flag
    config: Any = None
    if args.config_file:
        check_config(args.config_file)  # one line for a bad file (the default one: the script checks it)
    path = file_accelerate_launch_reads(args.config_file, bool(args.cpu))  # (the default one too: accelerate config's)
    if path:
        config = load_config_from_file(path)

    def pick(name: str, default: Any) -> Any:
        given = getattr(args, name, None)
        return given if given is not None else getattr(config, name, None) if config is not None else default

    setup = {
        "machines": int(pick("num_machines", 1) or 1),
        "machine_rank": int(pick("machine_rank", 0) or 0),
        "processes": pick("num_processes", None),
        "address": pick("main_process_ip", None) or "127.0.0.1",
        "port": int(pick("main_process_port", None) or DEFAULT_PORT),
        "script": args.training_script,
        "script_args": list(args.training_script_args),
        "engine": bool(args.use_deepspeed or args.use_megatron_lm)
        or any(kind in str(getattr(config, "distributed_type", "")) for kind in ("DEEPSPEED", "MEGATRON")),
        "use_cpu": bool(getattr(args, "cpu", False) or pick("use_cpu", False)),
    }
    check_address(setup["address"], setup["port"])
    machines, rank, processes = setup["machines"], setup["machine_rank"], setup["processes"]
    if not 0 <= rank < machines:
        raise UserError(
            f"--machine_rank {rank} cannot join a group of {machines} machines (num_machines): give each machine "
            f"its own rank from 0 to {machines - 1}"
        )
    if processes is not None and int(processes) % machines != 0:
        raise UserError(
            f"num_processes {processes} is not a multiple of num_machines {machines}: it is the total over all "
            "machines (machines x processes per machine), the same on every machine"
        )
    return setup


def check_address(address: str, port: int) -> None:
    """main_process_ip and main_process_port name a place a machine can reach: a port in range, an IP address or a
    name this machine resolves (a port of 70000 ended in a traceback; 256.1.1.1 in a wait until the bound)."""
    if not 1 <= port <= 65535:
        raise UserError(f"main_process_port {port} is not a port: give one from 1 to 65535 (e.g. {DEFAULT_PORT})")
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise UserError(
            f"main_process_ip {address} is neither an IP address nor a name this machine can resolve: give machine "
            "0's address (the same on every machine)"
        ) from None


def connected_peers(port: int) -> list[str]:
    """Remote addresses with an established TCP connection to local `port` (Linux /proc/net/tcp)."""
    peers: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state != "01" or int(local.rsplit(":", 1)[1], 16) != port:  # 01: ESTABLISHED
                continue
            peers.add(_address_of(remote.rsplit(":", 1)[0]))
    return sorted(peers)


def _address_of(hex_address: str) -> str:
    """/proc/net/tcp's address: 32-bit words in the host's (little-endian) order; IPv4 inside IPv6 shown as IPv4."""
    raw = bytes.fromhex(hex_address)
    address = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def what_is_seen(setup: dict[str, Any]) -> str:
    address, port, machines = setup["address"], setup["port"], setup["machines"]
    if setup["machine_rank"] == 0:
        peers = connected_peers(port)
        seen = f"{', '.join(peers)} (this machine's own agent among them)" if peers else "none yet"
        return f"listening on port {port} for the {machines - 1} other machine(s); connected from: {seen}"
    if answers(address, port):
        return f"machine 0 answers at {address}:{port}; waiting for the rest of the {machines} machines"
    return (
        f"nothing answers at {address}:{port}: machine 0 is not started yet, or main_process_ip/main_process_port "
        "is wrong, or a firewall is in the way"
    )


def training_started(launcher: subprocess.Popen, script: str) -> bool:
    """The agent starts the training processes (its children, running `script`) once the group has formed.

    Only a child that runs the script counts: the launcher has short-lived children of its own before that (an
    import's helper, such as ctypes' `ldconfig` lookup); taken for the training, one would end the join watch, which
    would then wait without a bound or a report.
    """
    name = os.path.basename(script)
    for _, command in child_processes(launcher.pid):
        arguments = command.decode(errors="replace").split("\0")
        if any(argument and os.path.basename(argument) == name for argument in arguments):
            return True
    return False


def stop_group(launcher: subprocess.Popen, grace_s: float = 5.0) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(launcher.pid, signum)
        except ProcessLookupError:
            return
        try:
            launcher.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run(accelerate_args: list[str], join_timeout_s: float, wait_report_s: float) -> int:
    setup = machine_setup(accelerate_args)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args], start_new_session=True
    )
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(launcher, setup, join_timeout_s, wait_report_s, received)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if launcher.poll() is None:
            stop_group(launcher)


def _watch(
    launcher: subprocess.Popen, setup: dict[str, Any], join_timeout_s: float, wait_report_s: float, received: list
) -> int:
    started = time.monotonic()
    who = f"machine {setup['machine_rank']} of {setup['machines']}"
    next_report = started + min(3.0, wait_report_s)
    while setup["machines"] > 1 and not training_started(launcher, setup["script"]):
        if launcher.poll() is not None:
            return launcher.returncode
        if received:
            stop_group(launcher)
            print(f"ddp-accel launch: stopped while {who} waited for the others", file=sys.stderr, flush=True)
            return 128 + received[0]
        waited = time.monotonic() - started
        if waited >= join_timeout_s:
            seen = what_is_seen(setup)
            stop_group(launcher)
            print(
                f"error: {who}: the group did not form at {setup['address']}:{setup['port']} within "
                f"--join-timeout-s {join_timeout_s:g} ({seen}); start the same command on every machine, each with "
                "its own --machine_rank, or check main_process_ip and main_process_port",
                file=sys.stderr,
                flush=True,
            )
            return 1
        if time.monotonic() >= next_report:
            print(
                f"ddp-accel launch: {who} waiting {waited:.0f} s (of --join-timeout-s {join_timeout_s:g}) for the "
                f"group at {setup['address']}:{setup['port']}: {what_is_seen(setup)}",
                file=sys.stderr,
                flush=True,
            )
            next_report += wait_report_s
        time.sleep(0.2)
    forwarded = 0
    while launcher.poll() is None:  # the training runs: signals go to the launcher, which passes them on
        if len(received) > forwarded:
            launcher.send_signal(received[forwarded])
            forwarded += 1
        time.sleep(0.2)
    return launcher.returncode


def main(argv: list[str]) -> int:
    """Its own two options (anywhere before the script); everything else is accelerate launch's, in order."""
    parser = ArgumentParser(
        prog="ddp-accel launch",
        description="accelerate launch with the same arguments, whose wait for the other machines is said, bounded "
        "and stopped by Ctrl-C",
        epilog="Every other argument is accelerate launch's (accelerate launch --help), then the script and its own.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--join-timeout-s", type=positive, default=600.0, help="how long to wait for every machine to join"
    )
    parser.add_argument("--wait-report-s", type=positive, default=10.0, help="how often to say what it waits for")
    parser.add_argument(
        "--recover",
        choices=("restart", "in-process"),
        default="restart",
        help="after a lost process: restart the group (accelerate launch's agent), or keep the survivors' "
        "processes and go on in a new group (one machine)",
    )
    parser.add_argument(
        "--min-processes",
        type=positive_int,
        help="--recover in-process: lost processes are not replaced while this many survive and divide the global "
        "batch into their --exact-micro-batch pieces: the run finishes on them (default: every loss replaced)",
    )
    parser.add_argument(
        "--stopped-timeout-s",
        type=positive,
        help="--recover in-process: a process stopped this long (SIGSTOP, a stuck driver), or silent this long "
        "once its peers' collective timed out on it (a deadlock: --timeout-s), is ended and recovered from as lost "
        "(default 30)",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="--recover in-process: this many processes besides the group's import and wait; a lost process is "
        "replaced by one of them at once, and another starts in its place (default 0: a replacement starts after "
        "the loss)",
    )
    args, accelerate_args = parser.parse_known_args(argv)
    if not accelerate_args:
        parser.error("give accelerate launch's arguments and the training script")
    if args.recover != "in-process" and (args.min_processes, args.stopped_timeout_s, args.spares) != (None, None, 0):
        parser.error("--min-processes, --stopped-timeout-s and --spares shape --recover in-process: give it")
    if args.spares < 0:
        parser.error("--spares: give 0 or more")
    if args.stopped_timeout_s is not None and args.stopped_timeout_s >= recovery.REPORT_TIMEOUT_S / 2:
        parser.error(
            f"--stopped-timeout-s: give less than {recovery.REPORT_TIMEOUT_S / 2:g} s (the survivors wait "
            f"{recovery.REPORT_TIMEOUT_S:g} s for their next group)"
        )
    if args.recover == "in-process":
        return launch_recovering_in_process(accelerate_args, args.min_processes, args.stopped_timeout_s, args.spares)
    return launch(accelerate_args, args.join_timeout_s, args.wait_report_s)


def launch_recovering_in_process(
    accelerate_args: list[str],
    min_processes: int | None = None,
    stopped_timeout_s: float | None = None,
    spares: int = 0,
) -> int:
    """The processes started here, around a store of this launcher's (ddp_accel.recovery)."""
    from ddp_accel.accelerate_config import process_variables

    try:
        setup = machine_setup(accelerate_args)
        if setup["machines"] > 1:
            raise UserError("--recover in-process runs the processes of one machine: give num_machines 1")
        if not setup["processes"] or int(setup["processes"]) < 2:
            raise UserError("--recover in-process needs 2 processes or more: give --num_processes N")
        processes = int(setup["processes"])
        if min_processes is not None and min_processes > processes:
            raise UserError(f"--min-processes {min_processes} is more than the {processes} processes launched")
        if setup["engine"]:
            raise UserError(
                "--recover in-process re-forms the process group itself: DeepSpeed's and Megatron-LM's engines keep "
                "groups of their own (restart instead: accelerate launch --max_restarts N)"
            )
        env = process_variables(accelerate_args)  # the config's and the flags' settings, as accelerate launch's
        if env.get(PARALLELISM, os.environ.get(PARALLELISM, "")).lower() == "true":
            raise UserError(
                "--recover in-process re-forms the process group at another size: a parallelism_config fixes its "
                "sizes (tensor, context, data parallel) for the run (restart instead: accelerate launch "
                "--max_restarts N)"
            )
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if setup["use_cpu"]:
        env["ACCELERATE_USE_CPU"] = "true"  # (what accelerate launch passes its processes)
    script_command = [setup["script"], *setup["script_args"]]
    return recovery.launch(script_command, processes, env, min_processes, stopped_timeout_s, spares)


def launch(accelerate_args: list[str], join_timeout_s: float = 600.0, wait_report_s: float = 10.0) -> int:
    try:
        return run(accelerate_args, join_timeout_s, wait_report_s)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
