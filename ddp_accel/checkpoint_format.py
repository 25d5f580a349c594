"""What a checkpoint holds, and the one code path that writes it.

A checkpoint is a folder in Accelerate's layout, which its `load_state` reads, beside the components of ddp_accel's
own (`Component`: each writes and reads its state under files of its own). Every file this rank writes is listed
once, in `write_checkpoint`, and given to a sink:

- the synchronous save's and a survivor's: `WriteNow`, which writes each file as it comes;
- an asynchronous save's: `async_save.StagedWrites`, which copies each state into memory at once and writes it in a
  background thread.

The files, in order (`N`: the model's or optimizer's index, Accelerate's names; `R`: the rank):

| file | whose | what |
|---|---|---|
| `model.safetensors`, `model_N.safetensors` | the main process | the model as Accelerate keeps it (no DDP wrapper) |
| `pytorch_model_fsdp_N/`, `optimizer_N/` | every rank, together | FSDP's shards (torch.distributed.checkpoint) |
| `pytorch_model_fsdp.bin`, `optimizer.bin` | the main process | FSDP's whole states under FULL_STATE_DICT |
| `optimizer.bin`, `optimizer_N.bin` | the main process | the optimizers' states |
| `scheduler.bin`, `scheduler_N.bin` | the main process | the schedulers' states |
| `sampler.bin`, `dl_state_dict.bin` | as Accelerate | an iterable dataset's sampler, a stateful loader's state |
| `scaler.pt` | every rank | the fp16 gradient scaler |
| `random_states_R.pkl` | each rank its own | Python's, numpy's, torch's generators (ddp_accel.random_streams) |
| a component's files | its own | the callbacks' states (`callback_states.pt`), each rank's PowerSGD state |

then `files.json` and `training_state.json`, written last by the main process (ddp_accel.checkpoint). Under
DeepSpeed, Megatron-LM, XLA and FSDP1 Accelerate's own `save_state` writes its part (through those engines), and
only synchronously. A survivor of a
lost peer (ddp_accel.rescue) writes the same list for every rank (`Replica`): the random streams every rank shared
at the step, the models' buffers as the step left them, and no collective.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ddp_accel.random_streams import RandomStreams

Write = Callable[[Any, Path], None]  # (an object, its file): writes it


@dataclass
class AcceleratorObjects:
    """What a run handed `Accelerator.prepare`, in its order: what Accelerate's `load_state` reads back."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)


class Component(Protocol):
    """A stateful part of a run that its checkpoints hold besides Accelerate's objects: registered once in the run's
    `Contents.components`, written by every save (synchronous, asynchronous, a survivor's) and read by the loader.

    `each_rank`: None when every rank holds the same state (the main process writes it), else why a rank's state is
    its own (then a survivor cannot write another rank's: the restart goes back to the last checkpoint)."""

    name: str

    @property
    def each_rank(self) -> str | None: ...

    def save(self, folder: Path, rank: int, ranks: int, save: Write) -> None:
        """Its files (every rank calls it; a state every rank shares: the main process, rank 0, writes it)."""

    def load(self, folder: Path, rank: int, ranks: int) -> list[str]:
        """Its state back from `folder`; notes to show."""


@dataclass
class Contents:
    """Everything a run's checkpoints hold besides training_state.json: the objects it handed Accelerate's prepare
    and its components."""

    objects: AcceleratorObjects = field(default_factory=AcceleratorObjects)
    components: list[Component] = field(default_factory=list)

    def each_rank(self) -> str | None:
        """Why a rank's part of the checkpoint is its own (a component's), or None."""
        return next((component.each_rank for component in self.components if component.each_rank), None)


@dataclass(frozen=True)
class Replica:
    """What a survivor writes for every rank: the random streams every rank shared at the step and the models'
    buffers as the step left them (by the model's index and the buffer's name)."""

    streams: RandomStreams
    buffers: dict[tuple[int, str], torch.Tensor]
    ranks: int


class Sink(Protocol):
    def add(self, write: Write, obj: Any, path: Path) -> None: ...

    def add_sharded(self, state: dict[str, Any], folder: Path, group: Any) -> None: ...


class WriteNow:
    """The synchronous save's sink: each file written as it comes, FSDP's shards by torch.distributed.checkpoint's
    save (every rank together)."""

    def add(self, write: Write, obj: Any, path: Path) -> None:
        write(obj, path)

    def add_sharded(self, state: dict[str, Any], folder: Path, group: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        folder.mkdir(parents=True, exist_ok=True)
        writer = dcp.FileSystemWriter(str(folder))
        dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(), process_group=group)


def write_safetensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    """A model's state as Accelerate's `save(..., safe_serialization=True)` writes it (tied weights once)."""
    from accelerate.utils import clean_state_dict_for_safetensors
    from safetensors.torch import save_file

    if isinstance(weights, collections.OrderedDict):
        weights = clean_state_dict_for_safetensors(weights)
    save_file(weights, str(path), metadata={"format": "pt"})


def numbered(name: str, index: int) -> str:
    """Accelerate's name of the `index`-th object's file: `optimizer.bin`, `optimizer_1.bin`."""
    stem, dot, suffix = name.partition(".")
    return name if index == 0 else f"{stem}_{index}{dot}{suffix}"


def writes_shared_files(accelerator: Any) -> bool:
    """Whether this rank writes the files one copy of which the checkpoint holds: the main process (with
    `save_on_each_node`, each machine's), as Accelerate's `save` decides."""
    if accelerator.project_configuration.save_on_each_node:
        return bool(accelerator.is_local_main_process)
    return bool(accelerator.is_main_process)


def write_checkpoint(
    accelerator: Any,
    folder: Path,
    contents: Contents,
    sink: Sink,
    groups: list[Any] | None = None,
    replica: Replica | None = None,
) -> None:
    """This rank's part of a checkpoint into `folder`, through `sink` (module docstring); under FSDP its shards over
    `groups` (one process group per sharded state: an asynchronous save's), else the default group. With a
    `replica`, every rank's part, written by this one process without a collective (a survivor's, under DDP)."""
    from accelerate.utils import DistributedType

    folder.mkdir(parents=True, exist_ok=True)
    shared = replica is not None or writes_shared_files(accelerator)
    objects = contents.objects
    if not listed_here(accelerator):  # (a synchronous save: --async-checkpoint and a survivor's refuse these)
        accelerator.save_state(str(folder))
    else:
        if accelerator.distributed_type == DistributedType.FSDP:
            write_fsdp_states(accelerator, folder, objects, sink, groups or [])
        else:
            write_models_and_optimizers(accelerator, folder, objects, sink, shared, replica)
        write_small_states(accelerator, folder, objects, sink, shared)
        streams = replica.streams if replica is not None else RandomStreams.now()
        ranks = range(replica.ranks) if replica is not None else [accelerator.process_index]
        for rank in ranks:
            sink.add(torch.save, streams.accelerate_states(accelerator.step), folder / f"random_states_{rank}.pkl")
    rank = 0 if replica is not None else accelerator.process_index  # (a survivor writes what rank 0 would)
    for component in contents.components:
        component.save(folder, rank, accelerator.num_processes, sink_save(sink))


def listed_here(accelerator: Any) -> bool:
    """Whether this module lists the strategy's files: one process, DDP, FSDP2. DeepSpeed's, Megatron-LM's, XLA's and
    FSDP1's are Accelerate's own `save_state`'s (it saves them through their engines)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return int(accelerator.state.fsdp_plugin.fsdp_version) == 2
    return kind == DistributedType.NO or str(kind.value).startswith("MULTI_")


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under Accelerate's wrapper: torch's FSDP2 state-dict functions may call `step()` to make
    an empty state, which on the wrapper would also step the fp16 gradient scaler (Accelerate unwraps it too)."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def sink_save(sink: Sink) -> Write:
    """A component's `save`, through the sink (torch.save at once, or staged)."""

    def save(obj: Any, path: Path) -> None:
        sink.add(torch.save, obj, path)

    return save


def write_models_and_optimizers(
    accelerator: Any, folder: Path, objects: AcceleratorObjects, sink: Sink, shared: bool, replica: Replica | None
) -> None:
    """Without FSDP: each model's state as Accelerate keeps it (with a replica, its buffers as the step left them),
    each optimizer's."""
    from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME

    if not shared:
        return
    for index, model in enumerate(objects.models):
        weights = accelerator.get_state_dict(model, unwrap=False)
        if replica is not None:
            kept = {name: value for (owner, name), value in replica.buffers.items() if owner == index}
            weights.update({name: value for name, value in kept.items() if name in weights})
        sink.add(write_safetensors, weights, folder / numbered(SAFE_WEIGHTS_NAME, index))
    for index, optimizer in enumerate(objects.optimizers):
        sink.add(torch.save, optimizer.state_dict(), folder / numbered(f"{OPTIMIZER_NAME}.bin", index))


def write_small_states(accelerator: Any, folder: Path, objects: AcceleratorObjects, sink: Sink, shared: bool) -> None:
    """The schedulers (the main process), an iterable dataset's sampler (the main process) and a stateful loader's
    state (every rank), the fp16 gradient scaler (every rank): as Accelerate's save_accelerator_state writes them."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
    from accelerate.utils import SAMPLER_NAME, SCALER_NAME, SCHEDULER_NAME

    if shared:
        for index, scheduler in enumerate(objects.schedulers):
            sink.add(torch.save, scheduler.state_dict(), folder / numbered(f"{SCHEDULER_NAME}.bin", index))
    for index, loader in enumerate(objects.dataloaders):
        if shared and isinstance(loader.dataset, IterableDatasetShard):
            sampler = loader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                sink.add(torch.save, sampler, folder / numbered(f"{SAMPLER_NAME}.bin", index))
        if getattr(loader, "use_stateful_dataloader", False):
            sink.add(torch.save, loader.state_dict(), folder / numbered("dl_state_dict.bin", index))
    if accelerator.scaler is not None:
        sink.add(torch.save, accelerator.scaler.state_dict(), folder / SCALER_NAME)


def fsdp_state_dict_options(plugin: Any, processes: int) -> Any:
    """The options under which Accelerate's FSDP2 save gathers its state dicts (`save_fsdp_model`): whole ones on
    rank 0, in CPU memory, for FULL_STATE_DICT on several processes; else the plugin's own."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    config, full = plugin.state_dict_config, is_full_state_dict(plugin)
    offload = processes > 1 if full else getattr(config, "offload_to_cpu", False)
    rank0 = processes > 1 if full else getattr(config, "rank0_only", False)
    return StateDictOptions(full_state_dict=full, cpu_offload=offload, broadcast_from_rank0=rank0)


def is_full_state_dict(plugin: Any) -> bool:
    return "FULL_STATE_DICT" in str(plugin.state_dict_type)


def write_fsdp_states(
    accelerator: Any, folder: Path, objects: AcceleratorObjects, sink: Sink, groups: list[Any]
) -> None:
    """Accelerate's FSDP2 layout: `pytorch_model_fsdp_N/` and `optimizer_N/` (shards, every rank; over `groups[i]`
    for the i-th sharded state, else the default group), or FULL_STATE_DICT's `pytorch_model_fsdp.bin` and
    `optimizer.bin`, gathered on every rank and written by the main process."""
    from accelerate.utils import OPTIMIZER_NAME
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = fsdp_state_dict_options(accelerator.state.fsdp_plugin, accelerator.num_processes)
    full, main = is_full_state_dict(accelerator.state.fsdp_plugin), accelerator.process_index == 0
    states: list[tuple[str, str, Any]] = []  # (file or folder, the key of a sharded save, how to gather the state)
    for index, model in enumerate(objects.models):
        name = numbered(f"{FSDP_MODEL_NAME}.bin", index) if full else f"{FSDP_MODEL_NAME}_{index}"
        states.append((name, "model", lambda model=model: get_model_state_dict(model, options=options)))
    for index, optimizer in enumerate(objects.optimizers):  # Accelerate pairs the i-th optimizer with the i-th model
        model = objects.models[index]
        name = numbered(f"{OPTIMIZER_NAME}.bin", index) if full else f"{OPTIMIZER_NAME}_{index}"
        optimizer = unwrapped_optimizer(optimizer)
        states.append((name, "optimizer", lambda m=model, o=optimizer: get_optimizer_state_dict(m, o, options=options)))
    for number, (name, key, gather) in enumerate(states):
        state = gather()  # (a collective: every rank, in this order)
        if not full:
            sink.add_sharded({key: state}, folder / name, groups[number] if groups else None)
        elif main:
            sink.add(torch.save, state, folder / name)
