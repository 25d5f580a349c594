"""FSDP2 on every machine, CPU-only ones included.

An accelerate config with `distributed_type: FSDP` (accelerate_configs/fsdp.yaml) reaches each process as
`ACCELERATE_USE_FSDP=true` and `FSDP_*` variables. Accelerate builds its FSDP plugin from them on any machine, but
keeps it only on GPU-like devices: on a CPU-only machine (accelerate/state.py, `AcceleratorState.__init__`) the
run becomes MULTI_CPU and the model is wrapped in DDP, silently. torch's FSDP2 (`fully_shard`) itself shards on a
CPU device mesh over gloo, and Accelerate's FSDP2 paths (prepare, `save_state`/`load_state` of sharded checkpoints,
`get_state_dict`) work there once the state says FSDP. `adopt_fsdp_on_cpu` says it, right after `Accelerator(...)`:

- the distributed type FSDP in `PartialState`'s shared state *and* in the AcceleratorState (which copies the shared
  one back: with only the latter, `save_state` takes the non-FSDP path and fails: "invalid python storage");
- the plugin, built from the same variables as Accelerate's own, with the run's mixed-precision policy.

Made for the Accelerate versions in `ADJUSTED_ACCELERATE`: outside them a run that would need the adjustment is
refused in one line naming that range (a state changed in a version it was not tested on could save or resume
wrongly). tests/test_fsdp.py fails the day Accelerate keeps the plugin on CPU by itself (then this is no longer
needed) or changes what is adjusted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddp_accel.errors import UserError
from ddp_accel.versions import major_minor

# [first, last] minor versions this adjustment was made and tested for; outside, a run that needs it is refused
ADJUSTED_ACCELERATE = ((1, 10), (1, 16))
# from this Accelerate on, FSDP2's loading of rank 0's weights (fsdp_cpu_ram_efficient_loading) broadcasts buffers
# too; before, every model with buffers failed ('Tensor' object has no attribute 'device_mesh')
LOADING_KEEPS_BUFFERS = (1, 16)


def fsdp_asked(env: dict[str, str] | None = None) -> bool:
    """Whether the launch asked for FSDP (accelerate launch of an FSDP config, or --use_fsdp)."""
    return (env if env is not None else os.environ).get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_plugin(env: Mapping[str, str] | None = None) -> Any:
    """The FSDP plugin Accelerate builds from a launch's FSDP_* variables (`env`, else this process's), or a
    UserError naming what Accelerate, or torch later, would refuse: an unknown version, a value it cannot read, a
    state-dict type FSDP2 has not. Every process of a launch asks it before its Accelerator: one line each, where the
    Accelerator (or its first save) ended in a traceback."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    saved = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        version = os.environ.get("FSDP_VERSION", "1")
        if version not in ("1", "2"):
            raise UserError(f"fsdp_version {version}: Accelerate has FSDP 1 and 2 (torch's FSDP2: fsdp_version: 2)")
        return FullyShardedDataParallelPlugin()
    except (ValueError, TypeError, KeyError, ImportError, RuntimeError) as error:
        raise UserError(f"the accelerate config's fsdp_config: {str(error).strip().splitlines()[0]}") from None
    finally:
        if env is not None:
            os.environ.clear()
            os.environ.update(saved)


CPU_FSDP2_ONLY = (
    "FSDP on a machine without GPUs runs torch's FSDP2 only: set `fsdp_version: 2` in the accelerate config "
    "(accelerate_configs/fsdp.yaml), or --fsdp_version 2"
)


def cpu_fsdp_plugin(env: Mapping[str, str] | None = None) -> Any:
    """The plugin of an FSDP launch on a machine without GPUs, or a UserError: what ddp_accel cannot run there."""
    if (env if env is not None else os.environ).get("FSDP_VERSION", "1") == "1":  # (FSDP1's plugin wants a GPU)
        raise UserError(CPU_FSDP2_ONLY)
    plugin = fsdp_plugin(env)
    problem = cpu_fsdp_problem(plugin)
    if problem is not None:
        raise UserError(problem)
    return plugin


def cpu_fsdp_problem(plugin: Any) -> str | None:
    """What an FSDP plugin asks that a machine without GPUs cannot run (ddp_accel runs FSDP2 over gloo there)."""
    import accelerate
    import torch

    for check in (
        lambda: check_accelerate_version(accelerate.__version__),
        lambda: check_torch_version(torch.__version__),
    ):
        try:
            check()
        except UserError as error:
            return str(error)
    if plugin.fsdp_version != 2:
        return CPU_FSDP2_ONLY
    if type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":  # it pins memory for a GPU's copies
        return "fsdp_offload_params: true offloads to the CPU what is there already: set it to false here"
    if plugin.cpu_ram_efficient_loading and (major_minor(accelerate.__version__) or (0, 0)) < LOADING_KEEPS_BUFFERS:
        return (
            f"fsdp_cpu_ram_efficient_loading: true fails with a model that has buffers (BatchNorm's statistics: "
            f"accelerate#3898) before Accelerate {LOADING_KEEPS_BUFFERS[0]}.{LOADING_KEEPS_BUFFERS[1]}, and this is "
            f"{accelerate.__version__}: set it to false (it saves no memory on a machine without GPUs), or upgrade "
            "Accelerate"
        )
    return None


def adopt_fsdp_on_cpu(accelerator: Any) -> bool:
    """Make a CPU run that asked for FSDP an FSDP2 run (module docstring). True when it adjusted the state."""
    import torch.distributed as dist
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if not fsdp_asked() or accelerator.device.type != "cpu" or accelerator.distributed_type == DistributedType.FSDP:
        return False
    try:
        plugin = cpu_fsdp_plugin()  # from the FSDP_* variables, as Accelerate builds its own
    except UserError as error:
        raise UserError(str(error), every_process=True) from None
    if accelerator.num_processes == 1 and not dist.is_initialized():  # a plain `python` run: FSDP2 needs a group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    return True


def check_accelerate_version(version: str) -> None:
    """A UserError when the installed Accelerate lies outside the versions the CPU adjustment was made for."""
    first, last = ADJUSTED_ACCELERATE
    if first <= (major_minor(version) or (0, 0)) <= last:
        return
    raise UserError(
        f"FSDP on a machine without GPUs adjusts Accelerate's state, which was made and tested for Accelerate "
        f"{first[0]}.{first[1]} to {last[0]}.{last[1]}, and this is Accelerate {version}: install one of those "
        f"(pip install 'accelerate>={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}'), or train with DDP "
        "(accelerate_configs/multi_gpu.yaml)"
    )


# torch's FSDP2 over gloo: before 2.7 its CPU stream cannot record events (every forward fails), and before 2.9
# gloo's reduce-scatter sums where FSDP2 asks for the average (pytorch#162338): N processes train with N times
# the gradients, silently
FSDP_ON_CPU_TORCH = (2, 9)


def check_torch_version(version: str) -> None:
    """A UserError when this torch's FSDP2 cannot train on CPU processes over gloo."""
    if (major_minor(version) or (0, 0)) >= FSDP_ON_CPU_TORCH:
        return
    raise UserError(
        f"FSDP on a machine without GPUs needs torch {FSDP_ON_CPU_TORCH[0]}.{FSDP_ON_CPU_TORCH[1]} or newer (older "
        f"FSDP2 over gloo sums gradients it should average), and this is torch {version}: upgrade torch, or train "
        "with DDP (accelerate_configs/multi_gpu.yaml)"
    )


@dataclass(frozen=True)
class ShardingSummary:
    """What the banner says of a sharded model: how many parameters each rank holds."""

    version: int
    reshard_after_forward: Any
    parameters: int
    per_rank: tuple[int, ...]

    def describe(self) -> str:
        if len(self.per_rank) <= 4:
            shares = ", ".join(f"{count:,} on rank {rank}" for rank, count in enumerate(self.per_rank))
        else:
            shares = f"{min(self.per_rank):,} to {max(self.per_rank):,} on each of {len(self.per_rank)} ranks"
        resharded = "resharded after forward" if self.reshard_after_forward else "kept whole from forward to backward"
        return f"FSDP{self.version} ({resharded}): {self.parameters:,} parameters, {shares}"


def sharding_summary(accelerator: Any, model: Any) -> ShardingSummary | None:
    """Each rank's share of a prepared FSDP2 model's parameters (a DTensor holds one shard on each rank); None
    without FSDP. Every rank calls it (one all-gather)."""
    import torch
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    plugin = accelerator.state.fsdp_plugin
    total = local = 0
    for parameter in model.parameters():
        total += parameter.numel()
        local += parameter.to_local().numel() if hasattr(parameter, "to_local") else parameter.numel()
    per_rank = accelerator.gather(torch.tensor([local], device=accelerator.device)).tolist()
    return ShardingSummary(plugin.fsdp_version, plugin.reshard_after_forward, total, tuple(per_rank))


def before_prepare(accelerator: Any, model: Any) -> None:
    """What a model needs before Accelerate prepares it under FSDP2: the buffers of rank 0 on every rank before
    each forward, as DDP does; under mixed precision, BatchNorm in fp32."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return
    if accelerator.num_processes > 1:
        broadcast_buffers_before_forward(model)
    if accelerator.mixed_precision != "no":
        keep_batchnorm_in_fp32(model)


def broadcast_buffers_before_forward(model: Any) -> bool:
    """FSDP2 shards parameters but leaves buffers (BatchNorm's running statistics) to each rank, which updates
    them from its own batches: the ranks' statistics drift apart, an evaluation scores each rank's model, and a
    sharded checkpoint keeps one rank's copy (torch.distributed.checkpoint saves a replicated tensor once), so a
    resume changed the other ranks' statistics. DDP broadcasts rank 0's buffers before every forward; so does this
    hook (one broadcast per dtype). False when the model has no buffers."""
    if not any(True for _ in model.buffers()):
        return False
    model.register_forward_pre_hook(_broadcast_buffers)
    return True


def before_save(accelerator: Any, models: list[Any]) -> None:
    """Under FSDP on several processes, rank 0's buffers of the prepared `models` on every rank before a checkpoint:
    it keeps one copy of them, which every rank loads at a resume (each rank updated its own in the step's
    forward)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1:
        for model in models:
            if any(True for _ in model.buffers()):
                _broadcast_buffers(model)


def _broadcast_buffers(module: Any, *args: Any) -> None:
    import torch
    import torch.distributed as dist

    by_dtype: dict[Any, list[Any]] = {}
    for buffer in module.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    with torch.no_grad():
        for buffers in by_dtype.values():
            flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
            dist.broadcast(flat, src=0)
            offset = 0
            for buffer in buffers:
                buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()


def keep_batchnorm_in_fp32(model: Any) -> int:
    """FSDP2's mixed precision casts every parameter to bf16, but not BatchNorm's running statistics (buffers):
    BatchNorm then fails ("expected scalar type BFloat16 but found Float"). Each BatchNorm layer of `model` computes
    in fp32 instead: its input and its (gathered) weight and bias are cast up for its forward, its output back to
    the input's type; the running statistics stay fp32, as they are under DDP with autocast. Returns the number of
    layers changed. Applied before `prepare`, under FSDP with mixed precision only."""
    import torch

    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.register_forward_pre_hook(_batchnorm_inputs_up)
            module.register_forward_hook(_batchnorm_output_back)
            changed += 1
    return changed


def _batchnorm_inputs_up(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    import torch

    x = args[0]
    low = {name: p for name, p in module._parameters.items() if p is not None and p.dtype != torch.float32}
    if x.dtype == torch.float32 and not low:
        return None
    module._fp32_restore = (x.dtype, dict(module._parameters))
    for name, parameter in low.items():  # a differentiable copy: the gradient flows back to FSDP's parameter
        module._parameters[name] = parameter.float()
    return (x.float(), *args[1:])


def _batchnorm_output_back(module: Any, args: tuple[Any, ...], output: Any) -> Any:
    restore = module.__dict__.pop("_fp32_restore", None)
    if restore is None:
        return None
    dtype, parameters = restore
    module._parameters.update(parameters)
    return output.to(dtype)
