"""Accelerator construction, the topology banner, guards and clean shutdown."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import inspect
import os
import platform
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.utils import DataLoaderConfiguration, DistributedType, ProjectConfiguration, set_seed
from accelerate.utils.memory import should_reduce_batch_size

from ddp_accel import comm_hooks, engines
from ddp_accel.budget import note_command_start
from ddp_accel.comm_hooks import PLAIN_DDP, DdpOptions
from ddp_accel.config import TrainConfig
from ddp_accel.elastic import (
    START_TIME,
    child_processes,
    end_with_the_launcher,
    parent_command,
    process_rank,
    report_to_launcher,
    stat_fields,
    stop_restarts,
)
from ddp_accel.engines import Outcome, record_outcome
from ddp_accel.errors import UserError
from ddp_accel.files import is_error
from ddp_accel.group_wait import while_the_group_forms
from ddp_accel.loaders import end_worker_processes, kill_leftover_workers
from ddp_accel.run_folder import RunFolder
from ddp_accel.sharding import adopt_fsdp_on_cpu, cpu_fsdp_plugin, fsdp_asked, fsdp_plugin
from ddp_accel.startup import imports_done, start_wanted_worker_server
from ddp_accel.stopping import (
    PEER_STOPPED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    EndedForAPeer,
    Phase,
    Preempted,
    StopSignals,
)
from ddp_accel.tracking import check_trackers, make_trackers, tracker_names
from ddp_accel.versions import untested_line


def has_accelerator() -> bool:
    """True when a GPU-like device is present. Does not initialise CUDA (safe before notebook_launcher)."""
    if torch.cuda.is_available():
        return True
    backends = getattr(torch, "xpu", None), getattr(torch.backends, "mps", None)
    return any(backend is not None and backend.is_available() for backend in backends)


def build_accelerator(
    *,
    seed: int = 0,
    output_dir: str | None = None,
    gradient_accumulation_steps: int = 1,
    mixed_precision: str | None = None,
    log_with: Any = None,
    timeout_s: int = 600,
    ddp: DdpOptions = PLAIN_DDP,
) -> Accelerator:
    """The one Accelerator every script uses.

    - `cpu=True` when there is no GPU: otherwise a 2-process launch of a GPU config on a CPU
      machine gives two independent world-size-1 trainings instead of one MULTI_CPU job (measured with
      accelerate 1.15: each process reports DistributedType.NO and world size 1).
    - A seedable sampler: the shuffle order of epoch e depends only on (seed, e), which makes
      mid-epoch resume and 1-vs-N-process runs reproducible.
    - The scheduler steps once per optimizer step whatever the world size (Accelerate's default
      steps it num_processes times per step).
    """
    cpu = not has_accelerator()
    # accelerate launch --mixed_precision and the YAML's mixed_precision reach the Accelerator by this variable
    if cpu and (mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION")) == "fp16":
        raise UserError(
            "mixed precision fp16 (--mixed-precision, accelerate launch --mixed_precision, or the accelerate config) "
            "needs a GPU; on CPU use bf16 or no"
        )
    check_launch_environment()
    check_fsdp_config(cpu)
    check_no_inherited_process_group()
    with while_the_group_forms(timeout_s, output_dir):  # an env:// rendezvous: silent, deaf to signals
        init_elastic_process_group(cpu, timeout_s)
        mixed_precision, _ = resolve_mixed_precision(mixed_precision, cpu)
        accelerator = Accelerator(
            cpu=cpu,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            log_with=log_with,
            # trackers write to logging_dir/<project name>: OUTPUT_DIR/tensorboard
            project_config=ProjectConfiguration(project_dir=output_dir, logging_dir=output_dir),
            # non_blocking: host-to-GPU copies of pinned batches overlap the previous step's compute
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed, non_blocking=True),
            step_scheduler_with_optimizer=False,
            kwargs_handlers=[
                InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s)),
                comm_hooks.ddp_kwargs(ddp, gloo=cpu),
            ],
        )
    adopt_fsdp_on_cpu(accelerator)  # an FSDP config on a machine without GPUs: FSDP2 over gloo, not DDP
    untested = untested_line()
    if untested and accelerator.is_main_process:
        print(untested, file=sys.stderr, flush=True)
    comm_hooks.check_hook(ddp.comm_hook, accelerator.distributed_type.value, accelerator.num_processes)
    check_topology(accelerator)
    set_seed(seed)
    return accelerator


def make_accelerator(
    config: TrainConfig, signals: StopSignals | None = None, check_output_dir: bool = True, **kwargs: Any
) -> Accelerator:
    """The Accelerator of a run of `config` (`open_run`'s, without its folder: `fit` then checks the folder again;
    `ddp_accel.Run` holds both). `kwargs`: more of DDP's options (find_unused_parameters=True)."""
    return open_run(config, signals, check_output_dir, **kwargs)[1]


def open_run(
    config: TrainConfig, signals: StopSignals | None = None, check_output_dir: bool = True, **kwargs: Any
) -> tuple[RunFolder, Accelerator]:
    """The output folder and the Accelerator of a run of `config`, after checking --output-dir (pass
    check_output_dir=False when not training into it); `signals` (run_main's) then leave their marker there if a
    preemption stops the run before training. A missing tracker package is one line here, before anything; the
    trackers start at the first log."""
    imports_done()  # a script that paused the garbage collector for its imports but runs without run_main
    folder = RunFolder(config.output_dir)
    if check_output_dir:
        folder.check(config.resume_from_checkpoint, config.overwrite_output_dir)
    if signals is not None:
        signals.set_output_dir(folder.path)
    config.check()
    names = tracker_names(config.report_to, config.with_tracking)
    if process_rank() == 0:  # the main process logs
        check_trackers(names, config.output_dir)
    if engines.current().checks_only():  # a launcher's driver checks the command before any worker starts
        raise OptionsChecked(config)
    # a tracker run continues only with the checkpoint it logged: `latest` without one starts a new run
    trackers = make_trackers(names, config.output_dir, resuming=folder.resumes(config.resume_from_checkpoint))
    accelerator = build_accelerator(
        seed=config.seed,
        log_with=trackers or None,
        output_dir=config.output_dir,
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        timeout_s=config.timeout_s,
        ddp=ddp_options(config, **kwargs),
    )
    return folder, accelerator


def ddp_options(config: TrainConfig, find_unused_parameters: bool = False) -> DdpOptions:
    """DDP's options of a run: --ddp-comm-hook and --powersgd-*, with their defaults."""
    return DdpOptions(
        config.ddp_comm_hook,
        config.powersgd_rank or PLAIN_DDP.powersgd_rank,
        config.powersgd_start_step or PLAIN_DDP.powersgd_start_step,
        find_unused_parameters,
    )


class OptionsChecked(BaseException):
    """Raised by make_accelerator under the CheckOnly engine (engines.use), once the options, --output-dir and the
    trackers are checked: the launcher's driver ran the script this far, in its own process (ddp_accel.ray_launch).
    A BaseException: no `except Exception` of a script takes it for a failure."""

    def __init__(self, config: TrainConfig):
        super().__init__("the command's options are checked")
        self.config = config


def init_elastic_process_group(cpu: bool, timeout_s: int) -> None:
    """Under a torchelastic agent (torchrun, accelerate launch), give every restart its own store keys.

    The workers of every restart share the agent's TCPStore, and the process group's keys (each rank's
    gloo address) do not depend on the attempt. A restarted rank can then read the address of a rank
    that was killed and fail with "Gloo connectFullMesh failed ... Connection refused" (what a restart after
    a SIGKILL of every worker meets). Accelerate uses a process group that exists.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    # unique per rendezvous: a node leaving uses up a restart, a node joining changes the world size (and not the
    # restart count), so the pair tells the groups of one job apart; and per launch on one machine (below)
    prefix = f"ddp_accel/restart_{restart}_world_{os.environ['WORLD_SIZE']}{launch_key()}"
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        store=dist.PrefixStore(prefix, store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def launch_key() -> str:
    """On one machine, a key of this launch that every worker shares: the agent's own log folder (torch elastic
    makes one per launch). A notebook's kernel keeps the store of its earlier launches (torch's static rendezvous
    reuses a store server of the same process), and their keys: without this a launch after a failed or
    interrupted one read the gloo addresses of the earlier workers (`Gloo connectFullMesh failed ... Connection
    refused` after 30 s, every later launch). On several machines each has its own folder: no key (each launch
    there is a new agent process with a new store)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return ""
    return "/" + Path(error_file).parents[2].name  # .../torchelastic_X/RUNID_Y/attempt_N/RANK/error.json -> RUNID_Y


def check_fsdp_config(cpu: bool) -> None:
    """An FSDP launch's settings, as Accelerate will read them (and, without a GPU, as ddp_accel runs them): one
    line on every process where the Accelerator would end in a traceback."""
    if not fsdp_asked():
        return
    try:
        cpu_fsdp_plugin() if cpu else fsdp_plugin()
    except UserError as error:
        raise UserError(str(error), every_process=True) from None


def check_launch_environment(env: dict[str, str] | None = None) -> None:
    """The launcher variables a process starts with must describe one job (each engine checks its own)."""
    engines.current(env).check()


def available_memory_bytes() -> int | None:
    """What this machine can still give (Linux: MemAvailable), or None where it cannot be read."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def check_memory(needed_bytes: float, what: str) -> None:
    """Refuse, before allocating, what cannot fit: the options that size a tensor are checked against the memory the
    machine has, instead of a process killed by the kernel (or a machine swapping) minutes later."""
    available = available_memory_bytes()
    if available is not None and needed_bytes > available:
        raise UserError(
            f"{what} needs about {needed_bytes / 2**30:,.1f} GiB of memory, and this machine has "
            f"{available / 2**30:,.1f} GiB available; choose smaller values"
        )


def check_topology(accelerator: Accelerator) -> None:
    """Refuse to run N silent duplicate trainings when the launcher started N processes, one process when
    `accelerate launch` was asked for several, and machines that run different numbers of processes."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        raise UserError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate sees "
            f"{accelerator.num_processes} ({accelerator.distributed_type}); each would train alone. "
            "Check the accelerate config (distributed_type, num_processes) or set ACCELERATE_USE_CPU=1."
        )
    if launched == 1 and "WORLD_SIZE" not in os.environ:
        asked = processes_asked_of_accelerate_launch(parent_command())
        if asked and asked > 1:
            raise UserError(
                f"accelerate launch was asked for {asked} processes (--num_processes), but its config starts one "
                "(distributed_type NO: accelerate_configs/cpu.yaml, or --cpu without --multi_gpu). For several "
                "processes on CPUs use --config_file accelerate_configs/multi_gpu.yaml: on a machine without a GPU it "
                "runs them over gloo"
            )
    if accelerator.num_processes > 1 and "LOCAL_WORLD_SIZE" in os.environ:
        check_processes_per_machine(accelerator)


def processes_asked_of_accelerate_launch(command: list[str]) -> int | None:
    """`--num_processes N` of an `accelerate launch` command line (None for another command)."""
    if not any(Path(part).name == "accelerate" or part.endswith("accelerate.commands.launch") for part in command):
        return None
    for index, part in enumerate(command):
        for flag in ("--num_processes", "--num-processes"):
            value = part[len(flag) + 1 :] if part.startswith(flag + "=") else None
            if part == flag and index + 1 < len(command):
                value = command[index + 1]
            if value is not None:
                try:
                    return int(value)
                except ValueError:
                    return None
    return None


def check_processes_per_machine(accelerator: Accelerator) -> None:
    """Every machine runs the same number of processes: accelerate launch with another --num_processes on one
    machine formed a group of 3 from 1 + 2 and trained without a word. Said by every process; under torchrun
    (which allows it) a warning."""
    if not engines.current().even_placement:  # Ray places workers on nodes as resources allow
        return
    mine = (int(os.environ.get("GROUP_RANK", "0") or 0), int(os.environ["LOCAL_WORLD_SIZE"]))
    gathered: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(gathered, mine)
    per_machine = dict(sorted(gathered))
    if len(set(per_machine.values())) <= 1:
        return
    counts = ", ".join(f"machine {rank}: {count}" for rank, count in per_machine.items())
    message = (
        f"the machines run different numbers of processes ({counts}; world size {accelerator.num_processes}): give "
        "every machine the same --num_processes (the total over all machines) and --num_machines"
    )
    if any(key.startswith("ACCELERATE_") for key in os.environ):  # accelerate launch: a misconfiguration
        raise UserError(message, every_process=True)
    if accelerator.is_main_process:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def topology(accelerator: Accelerator, batch_size: int | None = None, accumulation: int = 1) -> dict[str, Any]:
    state = accelerator.state
    info = {
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "backend": state.backend or "none",
        "world_size": accelerator.num_processes,
        "processes_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)),
        "num_nodes": int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", 1)) or 1),
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
    }
    engine = engines.current().banner()  # a launcher that is not torch's (ddp_accel.ray_launch)
    if engine:
        info = {"engine": engine, **info}
    if batch_size is not None:
        info["batch_size_per_process"] = batch_size
        info["gradient_accumulation_steps"] = accumulation
        info["global_batch_size"] = batch_size * accelerator.num_processes * accumulation
    return info


X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux: `flags` on x86, `Features` on Arm), or None elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    found = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return frozenset(found.group(1).split()) if found else None


def fast_bf16(onednn_bf16: bool, machine: str, flags: frozenset[str] | None, isa_cap: str | None) -> bool:
    """Whether bf16 runs natively on this CPU. oneDNN "supports" bf16 on every AVX-512 CPU, but without AVX512-BF16
    or AMX it emulates it: an AVX-512 Xeon without them ran a small ResNet 2.3x slower in bf16 than in fp32, an
    AVX2-only EPYC 8x slower. So on x86 the instructions must be there (flags), and oneDNN must not be capped below
    them (ONEDNN_MAX_CPU_ISA). An x86 CPU whose flags cannot be read gets fp32: at worst 1.7x slower than bf16
    (with AMX), where a wrong bf16 is 2-13x slower. Elsewhere (Arm) oneDNN's own check decides."""
    if not onednn_bf16:
        return False
    if machine.lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    cap = (isa_cap or "ALL").upper()
    if cap != "ALL" and "BF16" not in cap and "AMX" not in cap:
        return False
    return bool(flags and flags & X86_BF16_FLAGS)


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX (or an Arm CPU with bf16): see fast_bf16."""
    try:
        onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    return fast_bf16(onednn_bf16, platform.machine(), cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA"))


def resolve_mixed_precision(value: str | None, cpu: bool) -> tuple[str | None, str]:
    """`auto`: bf16 where it is fast (a GPU that supports it, a CPU with AVX512-BF16 or AMX), else no (fp32): on an
    AVX2-only CPU bf16 is emulated, 8-13x slower than fp32. Returns the precision and why (for the banner)."""
    if value != "auto":
        return value, ""
    if cpu:
        if cpu_has_fast_bf16():
            return "bf16", "auto: this CPU computes bf16 natively (AVX512-BF16/AMX)"
        return "no", "auto: bf16 would be emulated on this CPU (no AVX512-BF16/AMX), slower than fp32"
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16", "auto: this GPU supports bf16"
    return "no", "auto: this device has no fast bf16"


def print_banner(accelerator: Accelerator, title: str, **extra: Any) -> None:
    """One block at start, main process only, so a misconfigured topology is seen at once."""
    info = topology(accelerator, extra.pop("batch_size", None), extra.pop("accumulation", 1))
    asked = extra.pop("mixed_precision_asked", None)
    if asked == "auto":
        info["mixed_precision"] = (
            f"{info['mixed_precision']} ({resolve_mixed_precision('auto', info['device'] == 'cpu')[1]})"
        )
    elif info["device"] == "cpu" and info["mixed_precision"] == "bf16" and not cpu_has_fast_bf16():
        info["mixed_precision"] = "bf16 (emulated on this CPU, slower than fp32: use --mixed-precision auto or no)"
    info.update(extra)
    if accelerator.is_main_process:
        width = max(len(key) for key in info)
        lines = [f"== {title} =="] + [f"  {key:<{width}}  {value}" for key, value in info.items()]
        print("\n".join(lines), flush=True)


def shards_weights(accelerator: Accelerator) -> bool:
    """Whether no rank holds the whole weights (FSDP, DeepSpeed): the full ones are gathered on demand."""
    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def exported_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The model whose weights users read: without DDP's `module.` and without `_orig_mod.` where the accelerate
    config's dynamo_config wrapped it in torch.compile (--compile compiles in place: no wrapper); under
    FSDP/DeepSpeed the prepared model, from which the full weights are gathered."""
    if shards_weights(accelerator):
        return model
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def shutdown(clean: bool) -> None:
    """Tear down the process group after every DDP/gloo object is gone.

    The gloo teardown abort (`terminate called without an active exception`, ~1 run in 5) comes from
    DDP reducers and gloo work objects destroyed at interpreter exit, after their process group.
    `run_main` calls this once the script's main() has returned, so its locals (the prepared model,
    optimizer and loaders) are already released; garbage collection then destroys what reference
    cycles still hold before the group goes away. Without a group there is nothing to protect, and a full
    collection in a long-lived caller (a notebook, a test session) costs ~0.3 s a run.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        if clean:
            dist.barrier()  # nobody destroys the group while a peer still uses it
        dist.destroy_process_group()


INHERITED_GROUP = (
    "torch.distributed was initialised in the notebook's kernel before this launch (a cell made an Accelerator or "
    "called init_process_group), and the launched processes inherited its process group. Restart the kernel, and "
    "make the Accelerator inside the training function only"
)


def check_no_inherited_process_group() -> None:
    """A process group that exists before this process made one was forked from a notebook's kernel: using it
    (or destroying it) aborts the worker (`terminate called ... std::system_error`, exit -6)."""
    if not dist.is_available() or not dist.is_initialized():
        return
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and "TORCHELASTIC_RUN_ID" in os.environ and dist.get_world_size() != int(launched):
        raise UserError(INHERITED_GROUP)


# notebook_launcher's agent (torch elastic, in the kernel) forks the workers with its own handler of the stop signals
# installed, which raises SignalException (recognised by its module and name; another handler is left alone). A
# signal that arrives while a fork runs is handled inside an at-fork hook (logging's lock release), where CPython
# prints the exception as "ignored" and drops it: the stop button was lost and the training ran to its end. So while
# a fork runs that handler only records the signal, which is sent again once the fork is done, outside the hooks.
_handlers_during_fork: dict[int, Any] = {}
_signals_during_fork: list[int] = []


def _torch_elastic_signals() -> list[signal.Signals]:
    """The signals torch elastic's agent handles (its own variable, and its default)."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    return [getattr(signal, name.strip()) for name in names if isinstance(getattr(signal, name.strip(), None), int)]


def _raises_for_torch_elastic(handler: Any) -> bool:
    return (
        getattr(handler, "__module__", None) == "torch.distributed.elastic.multiprocessing.api"
        and getattr(handler, "__name__", None) == "_terminate_process_handler"
    )


def _record_a_signal_during_fork(signum: int, frame: Any) -> None:
    _signals_during_fork.append(signum)


def _hold_stop_signals_while_forking() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread handles signals: a fork from another thread drops none
    for signum in _torch_elastic_signals():
        handler = signal.getsignal(signum)
        if _raises_for_torch_elastic(handler):
            _handlers_during_fork[signum] = handler
            signal.signal(signum, _record_a_signal_during_fork)


def _restore_stop_handlers() -> None:
    for signum, handler in _handlers_during_fork.items():
        signal.signal(signum, handler)
    _handlers_during_fork.clear()


def _send_again_what_came_while_forking() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if _signals_during_fork:  # from another thread, a moment later: out of the hooks, where it would be dropped again
        threading.Timer(0.01, _send_recorded_signals, args=(os.getpid(),)).start()
    _restore_stop_handlers()  # last: the recorder still catches what comes while the thread starts


def _send_recorded_signals(pid: int) -> None:
    sent: set[int] = set()
    while _signals_during_fork:
        signum = _signals_during_fork.pop(0)
        if signum not in sent:
            sent.add(signum)
            os.kill(pid, signum)


def _forget_the_parents_signals() -> None:
    _restore_stop_handlers()  # the child's own handlers back; a signal the parent got is not the child's
    _signals_during_fork.clear()


@functools.cache  # once per process: at-fork hooks cannot be removed
def hold_stop_signals_during_forks() -> None:
    """In the process that runs notebook_launcher (the kernel), from the first `launched` function on."""
    os.register_at_fork(
        before=_hold_stop_signals_while_forking,
        after_in_parent=_send_again_what_came_while_forking,
        after_in_child=_forget_the_parents_signals,
    )


def _forks_since(parent: int, command: bytes, started: int) -> int:
    """Live children of `parent` that run `command` (forks of it: a fork keeps its parent's command line) and
    started no earlier than `started` (not a kernel's earlier children)."""
    return sum(
        fields[0] != "Z" and int(fields[START_TIME]) >= started and own == command
        for fields, own in child_processes(parent)
    )


def wait_for_the_other_forks(local_rank: int, local_world_size: int, timeout_s: float = 30.0) -> bool:
    """A worker forked by a launcher that runs in its own process (notebook_launcher: torch elastic's agent in the
    kernel) waits, before any network work, until the launcher has forked the workers after it (torch forks local
    ranks in order: rank r waits for `local_world_size - r` forks, itself included, that started no earlier).

    The agent's store server thread, in the kernel, looks up the name of every worker that connects
    (`getnameinfo`, which holds glibc's resolver lock). A worker forked at that moment inherits the lock held and
    hangs at its first name lookup, for good. No worker connecting before the last fork leaves no lookup to fork
    into.
    Returns whether this process waited (False: not a fork of its parent, or a lone worker); after `timeout_s`
    it says so and goes on."""
    if local_world_size <= 1:
        return False
    parent = os.getppid()
    try:
        command = Path("/proc/self/cmdline").read_bytes()
        if Path(f"/proc/{parent}/cmdline").read_bytes() != command:
            return False  # spawned or exec'd: a fresh process inherits no lock
        started = int(stat_fields("self")[START_TIME])
    except (OSError, ValueError, IndexError):
        return False
    deadline = time.monotonic() + timeout_s
    while _forks_since(parent, command, started) < local_world_size - local_rank:
        if time.monotonic() > deadline:
            print(
                f"warning: local rank {local_rank} waited {timeout_s:.0f} s for the launcher to fork the workers "
                f"after it (of {local_world_size}); starting without them",
                file=sys.stderr,
                flush=True,
            )
            break
        time.sleep(0.005)
    return True


def launched(function: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a training function for `notebook_launcher`/`debug_launcher`: it runs, its locals are released,
    then the distributed shutdown `run_main` does for scripts (no gloo teardown abort in the workers). A process
    group inherited from the kernel is named as the cause, not left to abort the worker; no worker starts before
    the launcher has forked them all (`wait_for_the_other_forks`); from here on, a stop signal that reaches this
    process while its launcher forks a worker is not lost (`hold_stop_signals_during_forks`)."""
    hold_stop_signals_during_forks()

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if dist.is_available() and dist.is_initialized() and "TORCHELASTIC_RUN_ID" in os.environ:
            raise UserError(INHERITED_GROUP)  # before any process group work: touching the kernel's aborts
        if "TORCHELASTIC_RUN_ID" in os.environ:  # notebook_launcher's agent runs in the kernel; debug_launcher none
            wait_for_the_other_forks(
                int(os.environ.get("LOCAL_RANK", "0") or 0), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
            )
        try:
            result = function(*args, **kwargs)
        except BaseException:
            shutdown(clean=False)
            raise
        shutdown(clean=True)
        return result

    return run


def lost_peers(error: BaseException) -> bool:
    """A collective failed because another process is gone (it ended with its own error, or was killed)."""
    return isinstance(error, getattr(dist, "DistError", ())) or bool(
        re.search(
            r"Connection closed by peer|Connection reset by peer|Broken pipe|NCCL communicator was aborted"
            r"|Timed out waiting",
            str(error),
        )
    )


def _interrupted(signals: StopSignals) -> int:
    """Ctrl-C: one line (rank 0) with where to continue from; exit status 130."""
    signals.enter(Phase.DONE)
    if process_rank() == 0:
        print(f"\ninterrupted (Ctrl-C). {signals.resume_hint}", file=sys.stderr, flush=True)
    return 130


def _while_interrupted(error: BaseException) -> bool:
    """The error was raised while a KeyboardInterrupt was being handled (its context chain holds one)."""
    seen: set[int] = set()
    context: BaseException | None = error
    while context is not None and id(context) not in seen:
        if isinstance(context, KeyboardInterrupt):
            return True
        seen.add(id(context))
        context = context.__context__
    return False


def _one_line(error: UserError) -> str:
    """A UserError raised in a DataLoader worker reaches us wrapped in the worker's traceback: keep its message."""
    message = str(error)
    if "Original Traceback" in message:
        message = message.strip().splitlines()[-1].split("UserError: ", 1)[-1]
    return message


OUT_OF_MEMORY_ADVICE = (
    "the batch does not fit; --auto-batch-size finds the largest per-process batch that does and keeps the global "
    "batch by accumulating gradients (or lower --batch-size and raise --gradient-accumulation-steps; "
    "--mixed-precision bf16 halves the activations)"
)


def _first_sentence(error: BaseException) -> str:
    return str(error).strip().split(". ")[0].rstrip(".") or type(error).__name__


def run_main(main: Callable[..., Any]) -> None:
    """Run a script's main(): user errors as one line (exit 2), a preemption after its checkpoint (exit 0), a clean
    distributed shutdown (exit 0). The process's StopSignals watch SIGTERM/SIGUSR1/SIGHUP from here to the exit; a main
    that takes one argument receives them (to pass to fit). How it ended is recorded (engines.last_outcome) for a
    launcher that ran the script in its own process."""
    imports_done()  # the collector paused for the imports runs again, what they made frozen before the fork
    start_wanted_worker_server()  # first: a fork while this process runs one thread of Python
    signals = StopSignals()
    note_command_start(started_as_script=getattr(main, "__module__", None) == "__main__")  # --time-budget's clock
    launcher_watch = None
    try:
        signals.install()  # a signal that came during the imports is handled here: Preempted (nothing trained yet)
        launcher_watch = end_with_the_launcher()
        main(signals) if inspect.signature(main).parameters else main()
        signals.enter(Phase.DONE)
        outcome = Outcome("completed", 0)
    except UserError as error:
        outcome = _user_error(error, signals)
    except Preempted as preempted:  # every rank saved its part of the checkpoint (or nothing was trained yet)
        signals.enter(Phase.DONE)
        if process_rank() == 0 or preempted.facts.before_training:  # any rank may be the one signalled
            print(preempted.message, file=sys.stderr, flush=True)
        code = PEER_STOPPED_EXIT_CODE if preempted.by_peer else PREEMPTED_EXIT_CODE
        outcome = Outcome("preempted", code, preempted.message, stop=dataclasses.asdict(preempted.facts))
        preempted.__traceback__ = None
    except EndedForAPeer as ended:  # the launcher ends the group: the failed process's line is the one to read
        signals.enter(Phase.DONE)
        outcome = Outcome("ended_for_a_peer", ended.code)
        ended.__traceback__ = None
    except KeyboardInterrupt:
        outcome = Outcome("interrupted", _interrupted(signals))
    except BaseException as error:
        if not is_error(error):  # SystemExit and the like: as they are
            raise
        signals.enter(Phase.DONE)
        outcome = _failed(error, signals)
    if launcher_watch is not None:
        launcher_watch.set()
    record_outcome(outcome)
    if engines.current().outlives_the_script:  # a Ray worker: its helpers serve the process, which goes on
        kill_leftover_workers()
    else:
        end_worker_processes()  # so that the command returns with nothing left in its process group
    shutdown(clean=outcome.code in (0, PEER_STOPPED_EXIT_CODE))
    signals.uninstall()
    note_command_start(None)  # a later fit() in this process (a notebook) counts from its own start
    sys.exit(outcome.code)


def _user_error(error: UserError, signals: StopSignals) -> Outcome:
    signals.enter(Phase.DONE)
    message = f"error: {_one_line(error)}"
    if process_rank() == 0 or error.every_process:
        print(message, file=sys.stderr, flush=True)
    report_to_launcher(message)
    stop_restarts()  # a user error fails the same way at every restart of the launcher
    error.__traceback__ = None  # drop frames holding models before teardown
    return Outcome("user_error", 2, message)


def _failed(error: BaseException, signals: StopSignals) -> Outcome:
    """A crash: one line where the cause is known (a file, memory, a lost peer), else the traceback."""
    if _while_interrupted(error):  # a library's cleanup failed on the way out of a Ctrl-C (a worker pool's join)
        return Outcome("interrupted", _interrupted(signals))
    if isinstance(error, OSError) and error.filename is not None:  # read-only, full, a file for a folder...
        message = f"error: cannot write or read {error.filename}: {error.strerror}"
        if process_rank() == 0:
            print(message, file=sys.stderr, flush=True)
        report_to_launcher(message)
        stop_restarts()
        return Outcome("user_error", 2, message)
    if should_reduce_batch_size(error):  # a CUDA/cuDNN/CPU allocator's out of memory: what to change
        message = f"error: process {process_rank()} ran out of memory ({_first_sentence(error)}): "
        message += OUT_OF_MEMORY_ADVICE
        print(message, file=sys.stderr, flush=True)
    elif lost_peers(error):
        message = (
            f"error: process {process_rank()} lost contact with the others: another process ended (its own message "
            f"says why), or no answer came within the collective timeout (--timeout-s): a machine or the network "
            f"between them is gone ({type(error).__name__})"
        )
        print(message, file=sys.stderr, flush=True)
        return Outcome("crashed", 1, message)
    else:
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}"
    report_to_launcher(message)
    return Outcome("crashed", 1, message)
