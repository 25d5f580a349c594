"""The Accelerator every script uses (`build_accelerator`, `open_run`) and what is checked around it: the launcher's
variables, the topology, the FSDP config, memory, the precision a CPU runs fast; the banner that says it all."""

from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.utils import DataLoaderConfiguration, DistributedType, ProjectConfiguration, set_seed

from ddp_accel import comm_hooks, launch_environments, recovery
from ddp_accel.comm_hooks import PLAIN_DDP, DdpOptions
from ddp_accel.config import POWERSGD_DEFAULTS, TrainConfig
from ddp_accel.config_file import check_launched_config, has_accelerator, launched_config, settings_named
from ddp_accel.elastic import process_rank
from ddp_accel.errors import UserError
from ddp_accel.group_wait import while_the_group_forms
from ddp_accel.notebook import check_no_inherited_process_group
from ddp_accel.run_folder import RunFolder
from ddp_accel.sharding import adopt_fsdp_on_cpu, cpu_fsdp_plugin, fsdp_asked, fsdp_plugin
from ddp_accel.startup import imports_done, mark
from ddp_accel.stopping import (
    StopSignals,
)
from ddp_accel.tracking import check_trackers, make_trackers, tracker_names
from ddp_accel.versions import untested_line


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
      machine gives two independent world-size-1 trainings instead of one MULTI_CPU job (each process sees
      DistributedType.NO and world size 1).
    - A seedable sampler: the shuffle order of epoch e depends only on (seed, e), which makes
      mid-epoch resume and 1-vs-N-process runs reproducible.
    - The scheduler steps once per optimizer step whatever the world size (Accelerate's default
      steps it num_processes times per step).
    """
    check_launched_config(precision=mixed_precision)  # the file accelerate launch was given, as check-config reads it
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
    mark_lomo_absent()
    with while_the_group_forms(timeout_s, output_dir):  # an env:// rendezvous: silent, deaf to signals
        init_elastic_process_group(cpu, timeout_s)
        mixed_precision, _ = resolve_mixed_precision(mixed_precision, cpu)
        with settings_named():  # an error a setting caused (Accelerate's, torch's): one line naming the setting
            accelerator = ConfiguredAccelerator(
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
    with settings_named():
        adopt_fsdp_on_cpu(accelerator)  # an FSDP config on a machine without GPUs: FSDP2 over gloo, not DDP
    if (untested := untested_line()) and accelerator.is_main_process:
        print(untested, file=sys.stderr, flush=True)
    comm_hooks.check_hook(ddp.comm_hook, accelerator.distributed_type.value, accelerator.num_processes)
    accelerator.ddp_options = ddp
    check_topology(accelerator)
    set_seed(seed)
    return accelerator


class ConfiguredAccelerator(Accelerator):
    """Accelerate's Accelerator whose `prepare` tells an error a setting caused (a layer class the model does not
    have, say) in one line naming the setting and its fix, whoever calls it: fit, or a script's own loop. It keeps
    the DDP options it was built with (`ddp_options`), which the run reads instead of deriving them again."""

    ddp_options: DdpOptions | None = None

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        models = [arg for arg in args if isinstance(arg, torch.nn.Module)]
        with settings_named(lambda: setting_hints(models)):
            return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with settings_named(lambda: setting_hints([model])):
            return super().prepare_model(model, *args, **kwargs)


def setting_hints(models: list[torch.nn.Module]) -> dict[str, str]:
    """The fix of a setting that names the model's parts, from the models being prepared."""
    classes = sorted({type(part).__name__ for model in models for part in model.modules()})
    classes = [name for name in classes if name not in {type(model).__name__ for model in models}]
    return {
        "fsdp_transformer_layer_cls_to_wrap": f"name classes of the model's layers (this model has "
        f"{', '.join(classes[:20]) or 'no layers of other classes'}), or set fsdp_auto_wrap_policy: SIZE_BASED_WRAP"
    }


def mark_lomo_absent() -> None:
    """Accelerate asks whether the LOMO optimizers are installed at every optimizer.step(), twice
    (`importlib.util.find_spec("lomo_optim")`: a search of every sys.path entry, ~7% of a 2 ms step). Where the
    package is absent, a None in sys.modules, Python's own mark of a module that is not there, answers the same at
    once; an installed lomo_optim is left alone (so is one installed later in a notebook's kernel: delete the mark)."""
    if "lomo_optim" not in sys.modules and importlib.util.find_spec("lomo_optim") is None:
        sys.modules["lomo_optim"] = None  # type: ignore[assignment]


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
    if os.environ.get(recovery.JOINS):  # a replacement, called in once its peers saved the step it joins at:
        recovery.wait_to_be_called(config.timeout_s)  # the folder is read after that save
    folder = RunFolder(config.output_dir)
    if check_output_dir:
        folder.check(config.resume_from_checkpoint, config.overwrite_output_dir)
    if signals is not None:
        signals.set_output_dir(folder.path)
    config.check()
    names = tracker_names(config.report_to, config.with_tracking)
    if process_rank() == 0:  # the main process logs
        check_trackers(names, config.output_dir)
    if launch_environments.current().checks_only():  # a launcher's driver checks the command before any worker starts
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
    mark("accelerator")  # Accelerate's state and the process group
    return folder, accelerator


def built_ddp_options(accelerator: Accelerator, config: TrainConfig) -> DdpOptions:
    """The DDP options the Accelerator was built with (build_accelerator's), else those of the options (an
    Accelerator of your own)."""
    return getattr(accelerator, "ddp_options", None) or ddp_options(config)


def ddp_options(config: TrainConfig, find_unused_parameters: bool = False) -> DdpOptions:
    """DDP's options of a run: --ddp-comm-hook and --powersgd-*, with their defaults."""
    return DdpOptions(
        config.ddp_comm_hook,
        config.powersgd_rank or POWERSGD_DEFAULTS["powersgd_rank"],
        config.powersgd_start_step or POWERSGD_DEFAULTS["powersgd_start_step"],
        find_unused_parameters,
    )


class OptionsChecked(BaseException):
    """Raised by make_accelerator under the CheckOnly launch environment (launch_environments.use), once the options,
    --output-dir and the trackers are checked: the launcher's driver ran the script this far, in its own process
    (ddp_accel.ray_launch). A BaseException: no `except Exception` of a script takes it for a failure."""

    def __init__(self, config: TrainConfig):
        super().__init__("the command's options are checked")
        self.config = config


def init_elastic_process_group(cpu: bool, timeout_s: int) -> None:
    """Under a launcher that owns the store (torchrun's agent, accelerate launch, `ddp-accel launch --recover
    in-process`), give every group of the job its own store keys.

    The workers of every restart share the agent's TCPStore, and the process group's keys (each rank's
    gloo address) do not depend on the attempt. A restarted rank can then read the address of a rank
    that was killed and fail with "Gloo connectFullMesh failed ... Connection refused" (what a restart after
    a SIGKILL of every worker meets). Accelerate uses a process group that exists.
    """
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if recovery.under_in_process_recovery():  # each group the launcher forms after a loss: a generation
        recovery.meet(timeout_s)
        store, prefix = recovery.store_client(timeout_s), recovery.store_prefix()
    else:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
        # unique per rendezvous: a node leaving uses up a restart, a node joining changes the world size (and not
        # the restart count), so the pair tells the groups of one job apart; and per launch on one machine (below)
        prefix = f"ddp_accel/restart_{restart}_world_{os.environ['WORLD_SIZE']}{launch_key()}"
    try:
        dist.init_process_group(
            "gloo" if cpu else "nccl",
            store=dist.PrefixStore(prefix, store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    except Exception:  # a member lost after the meeting, before its connections (seen at --timeout-s): given up
        if recovery.given_up():
            raise recovery.Regroup(None) from None
        raise


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
    line (the main process's) where the Accelerator would end in a traceback."""
    if not fsdp_asked():
        return
    try:
        cpu_fsdp_plugin() if cpu else fsdp_plugin()
    except UserError as error:
        path = launched_config()
        raise UserError(f"{path}: {error}" if path else str(error)) from None


def check_launch_environment(env: dict[str, str] | None = None) -> None:
    """The launcher variables a process starts with must describe one job (each launch environment checks its own)."""
    launch_environments.current(env).check()


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
        asked = processes_asked_of_accelerate_launch(launch_environments.parent_command())
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
    if not launch_environments.is_accelerate_launch(command):
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
    if not launch_environments.current().even_placement:  # Ray places workers on nodes as resources allow
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
    launcher = launch_environments.current().banner()  # a launcher that is not torch's (ddp_accel.ray_launch)
    if launcher:
        info = {"launcher": launcher, **info}
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
