"""What a checkpoint holds, the one code path that writes it, and the one loader that reads it (`load_checkpoint`:
every check first, then Accelerate's `load_state`, then each component).

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
at the step, the models' buffers as the step left them, and no collective. Under in-process recovery each survivor
also keeps its copy (`hold`), which its next load takes instead of the files (`load_checkpoint(held=...)`); a
replacement that joins them is given a survivor's copy over the group (`share_held`).
"""

from __future__ import annotations

import collections
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ddp_accel import peer_copy
from ddp_accel.callback_state import POSITIONAL
from ddp_accel.errors import UserError
from ddp_accel.identity import compare_identity
from ddp_accel.random_streams import RandomStreams
from ddp_accel.state import RunIdentity, TrainState

TRAINING_STATE = "training_state.json"  # TrainState.state_dict(), written last: a checkpoint without it is incomplete
FILE_LIST = "files.json"  # the name and size of every file of the checkpoint
Reader = Callable[[Path], dict[str, Any]]  # a checkpoint's training_state.json

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
    create: bool = True,
) -> None:
    """This rank's part of a checkpoint into `folder`, through `sink` (module docstring); under FSDP its shards over
    `groups` (one process group per sharded state: an asynchronous save's), else the default group. With a
    `replica`, every rank's part, written by this one process without a collective (a survivor's, under DDP).
    `create=False`: `folder` is not made (a sink that only holds the files in memory)."""
    from accelerate.utils import DistributedType

    if create:
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


def read_training_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((path / TRAINING_STATE).read_text())
    return state


def checkpoint_problem(accelerator: Accelerator, path: Path, read: Reader | None = None) -> str | None:
    """Every rank checks the files of the checkpoint (names and sizes against the list saved with it, and that its
    own RNG state reads), then the ranks agree: returns what is wrong (as seen here, or on another rank) or None."""
    try:
        state = (read or read_training_state)(path)
        listed = json.loads((path / FILE_LIST).read_text()) if (path / FILE_LIST).is_file() else state.get("files", {})
        problem = None
        for name, size in listed.items():  # checkpoints of older versions list theirs in training_state.json
            if not (path / name).is_file():
                problem = f"{name} is missing"
            elif (path / name).stat().st_size != size:
                problem = f"{name} has {(path / name).stat().st_size} bytes, {size} when saved"
            if problem:
                break
        rng = path / f"random_states_{accelerator.process_index}.pkl"
        if problem is None and rng.is_file():
            torch.load(rng, weights_only=False)  # Accelerate would only log a failure here and go on with other RNG
    except Exception as error:  # unreadable JSON or pickle
        problem = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    damaged = accelerator.reduce(torch.tensor(float(problem is not None), device=accelerator.device), "sum")
    if damaged.item() and problem is None:
        problem = "damaged on another process"
    return problem


FSDP_MODEL_FOLDER = "pytorch_model_fsdp_0"  # what Accelerate's save_state writes under FSDP (a sharded state dict)


def check_strategy(accelerator: Accelerator, path: Path) -> None:
    """A checkpoint of FSDP shards loads only under FSDP (on any number of processes), and one of whole weights
    only without it: otherwise Accelerate fails deep inside on a file that is not there."""
    sharded = any(path.glob("pytorch_model_fsdp*"))  # the folder of a sharded state dict, or a full one's .bin
    if sharded == (accelerator.distributed_type == DistributedType.FSDP):
        return
    if sharded:
        raise UserError(
            f"checkpoint {path} holds an FSDP model ({FSDP_MODEL_FOLDER}/ or .bin), and this run does not shard "
            f"(distributed type {accelerator.distributed_type.value}): resume it under the FSDP config it was "
            "written with (e.g. accelerate_configs/fsdp.yaml, on any number of processes)"
        )
    raise UserError(
        f"checkpoint {path} holds whole weights (written without FSDP), and this run shards them with FSDP: "
        "resume it under the config it was written with (e.g. accelerate_configs/multi_gpu.yaml or cpu.yaml)"
    )


def load_checkpoint(
    accelerator: Accelerator,
    path: Path,
    identity: RunIdentity,
    state: TrainState | None = None,
    contents: Contents | None = None,
    read: Reader | None = None,
    held: HeldCheckpoint | None = None,
) -> list[str]:
    """Load the checkpoint at `path` into the prepared objects, `state` and the `contents`' callbacks and hooks, when
    the checkpoint is of this run's `identity` (a checkpoint of another model or run is refused). Without `contents`
    the callbacks' part is not read (an evaluation of the checkpoint's weights). With `held` (`take_held`), the
    models' and optimizers' states come from this process's memory instead of the files. Returns warnings to
    show."""
    if held is None:
        return load_files(accelerator, path, identity, state, contents, read)
    assert contents is not None, "a held checkpoint loads into a run's contents"
    try:  # its small files from its own folder: `path` may still be being written
        return load_files(accelerator, held.small, identity, state, contents, None, held)
    finally:
        held.let_go()


def load_files(
    accelerator: Accelerator,
    path: Path,
    identity: RunIdentity,
    state: TrainState | None,
    contents: Contents | None,
    read: Reader | None,
    held: HeldCheckpoint | None = None,
) -> list[str]:
    """`load_checkpoint` of the files at `path`, the models' and optimizers' states from `held` where given."""
    saved, warning = check_checkpoint(accelerator, path, identity, read)
    try:
        if held is not None and contents is not None:
            load_held(accelerator, path, contents.objects, held)
        else:
            load_accelerate_state(accelerator, path)
        if contents is not None and sharded_optimizer_left_unloaded(accelerator):
            load_sharded_optimizers(contents.objects, path)
    except (RuntimeError, FileNotFoundError, KeyError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load checkpoint {path}: {first_line}") from None
    notes = [warning] if warning else []
    for component in contents.components if contents is not None else []:
        notes += component.load(path, accelerator.process_index, accelerator.num_processes)
    if state is not None:
        state.load_state_dict(saved)
    return notes


def load_accelerate_state(accelerator: Accelerator, path: Path) -> None:
    """Accelerate's `load_state` of the checkpoint's Accelerate layout. It refuses files it has no registered object
    for: an earlier version's callback states (`custom_checkpoint_N.pkl`, read by their component) are left out of
    its sight (a folder of links to the others)."""
    if not any(POSITIONAL.match(entry.name) for entry in path.iterdir()):
        accelerator.load_state(str(path))
        return
    with tempfile.TemporaryDirectory(prefix=".ddp_accel_checkpoint_") as view:
        for entry in path.iterdir():
            if not POSITIONAL.match(entry.name):
                Path(view, entry.name).symlink_to(entry.resolve())
        accelerator.load_state(view)


@dataclass
class HeldCheckpoint:
    """A checkpoint this process holds besides its files (a survivor's copy of the step it reached, for its next
    group under `--recover in-process`): the models' and optimizers' states in memory by file name (the bulk,
    which the next load takes from here instead of reading it back), and the rest, small, in a folder of this
    process's own (`small`: complete with training_state.json), so that a load needs nothing of `folder`, which
    another survivor may still be writing. `given_by`: the process that gave it to this one (None: its own);
    `written_meanwhile`: this process writes the same objects in the background (ddp_accel.rescue)."""

    folder: Path
    step: int
    files: dict[str, Any]
    small: Path
    given_by: int | None = None
    written_meanwhile: bool = False

    def let_go(self) -> None:
        shutil.rmtree(self.small, ignore_errors=True)


HELD: list[HeldCheckpoint] = []  # at most one: the newest


def bulk_files(objects: AcceleratorObjects) -> list[str]:
    """The files of the models' and optimizers' states (Accelerate's names)."""
    from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME

    models = [numbered(SAFE_WEIGHTS_NAME, index) for index in range(len(objects.models))]
    return models + [numbered(f"{OPTIMIZER_NAME}.bin", index) for index in range(len(objects.optimizers))]


def hold(
    folder: Path, staged: Any, staged_in: Path, objects: AcceleratorObjects, training_state: str
) -> HeldCheckpoint:
    """Keep the checkpoint `folder` that `staged` (async_save.StagedWrites, its copies staged for the folder
    `staged_in`) holds: the bulk in memory, the rest written into a folder of this process's own with
    `training_state`. The one held before is let go."""
    bulk = set(bulk_files(objects))
    small = Path(tempfile.mkdtemp(prefix=f".ddp_accel_held_{folder.name}_"))
    files = {}
    for write, obj, path in staged.writes:
        name = path.relative_to(staged_in).as_posix()
        if name in bulk:
            files[name] = obj
        else:
            write(obj, small / name)
    (small / TRAINING_STATE).write_text(training_state)
    return keep(HeldCheckpoint(folder, int(json.loads(training_state)["step"]), files, small))


def keep(held: HeldCheckpoint) -> HeldCheckpoint:
    let_go_held()
    HELD.append(held)
    return held


def let_go_held() -> None:
    while HELD:
        HELD.pop().let_go()


def held_step() -> int | None:
    """The step of the checkpoint this process holds, or None."""
    return HELD[0].step if HELD else None


def share_held(folder: Path, step: int) -> None:
    """Every process of the group at the same point, where its survivors hold `step` in memory: a process that
    does not (a replacement) is given the copy of the first that does (ddp_accel.peer_copy), and holds it for
    `folder` as its own; no file of the step is read."""
    import torch.distributed as dist

    own = HELD[0] if HELD and HELD[0].step == step else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    given = peer_copy.share((rank, own.files, contents_of(own.small)) if own else None)
    if own is None and given is not None:
        giver, files, small = given
        its_own = Path(tempfile.mkdtemp(prefix=f".ddp_accel_held_{folder.name}_"))
        for name, data in small.items():
            (its_own / name).parent.mkdir(parents=True, exist_ok=True)
            (its_own / name).write_bytes(data)
        keep(HeldCheckpoint(folder, step, files, its_own, giver))


def contents_of(folder: Path) -> dict[str, bytes]:
    """Each file under `folder` (its path there) -> its bytes."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def take_held(folder: Path) -> HeldCheckpoint | None:
    """The checkpoint held for `folder`, or None; whatever was held is no longer (used once: the caller lets it
    go once loaded)."""
    held = HELD.pop() if HELD else None
    if held is not None and held.folder.resolve() != folder.resolve():
        held.let_go()
        return None
    return held


def load_held(accelerator: Accelerator, path: Path, objects: AcceleratorObjects, held: HeldCheckpoint) -> None:
    """Accelerate's load of the checkpoint at `path`, but the models' and optimizers' states from `held` (in
    memory): the rest (schedulers, loaders' samplers, the gradient scaler, this rank's random streams) by
    Accelerate's own `load_accelerator_state`, as its `load_state` reads them."""
    from accelerate.checkpointing import load_accelerator_state

    names = iter(bulk_files(objects))  # (the models' first, then the optimizers')
    for model in objects.models:
        model.load_state_dict(held.files[next(names)])
    for optimizer in objects.optimizers:
        # an optimizer trains on the very tensors it loads (torch does not copy them): copies, where those are
        # still being written in the background
        state = held.files[next(names)]
        optimizer.load_state_dict(peer_copy.cloned(state) if held.written_meanwhile else state)
    scaler, index = accelerator.scaler, accelerator.process_index
    override = load_accelerator_state(str(path), [], [], objects.schedulers, objects.dataloaders, index, scaler)
    if "step" in override:
        accelerator.step = override["step"]


# Accelerate before 1.13 loads an FSDP2 sharded optimizer state into the template `optimizer.state_dict()`, empty
# until the first step: nothing is loaded, silently (the optimizer restarts at every resume); 1.13 asks torch's
# get_optimizer_state_dict for the template, as load_sharded_optimizers does
SHARDED_OPTIMIZER_LOADED_FROM = (1, 13)


def sharded_optimizer_left_unloaded(accelerator: Accelerator) -> bool:
    """Whether this Accelerate's load_state left an FSDP2 run's sharded optimizer state unloaded."""
    import accelerate

    if accelerator.distributed_type != DistributedType.FSDP or is_full_state_dict(accelerator.state.fsdp_plugin):
        return False
    version = tuple(int(part) for part in accelerate.__version__.split(".")[:2] if part.isdigit())
    return accelerator.state.fsdp_plugin.fsdp_version == 2 and version < SHARDED_OPTIMIZER_LOADED_FROM


def load_sharded_optimizers(objects: AcceleratorObjects, path: Path) -> None:
    """Each optimizer's shards of `path` (`optimizer_N/`, Accelerate's layout), by torch's public state-dict API:
    the template from get_optimizer_state_dict, then torch.distributed.checkpoint's load. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    for index, optimizer in enumerate(objects.optimizers):
        model, optimizer = objects.models[index], unwrapped_optimizer(optimizer)
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path / f"optimizer_{index}"))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def check_checkpoint(
    accelerator: Accelerator, path: Path, identity: RunIdentity, read: Reader | None = None
) -> tuple[dict[str, Any], str | None]:
    """Every check before a load (complete on every rank, the model, the optimizer, sharded or not, the options of
    the identity): its training state and a warning to show, or a UserError."""
    problem = checkpoint_problem(accelerator, path, read)
    if problem:
        raise UserError(f"checkpoint {path} is damaged ({problem}); resume another step_N folder or 'latest'")
    saved = (read or read_training_state)(path)
    if saved.get("model_fingerprint") != identity.model_fingerprint:
        raise UserError(
            f"checkpoint {path} was written by another model ({saved.get('model_fingerprint')}, "
            f"this run builds {identity.model_fingerprint}); resume with the same model options or use a new "
            "--output-dir."
        )
    saved_optimizer = saved.get("optimizer_fingerprint")  # not in checkpoints of earlier versions
    if saved_optimizer and identity.optimizer_fingerprint and saved_optimizer != identity.optimizer_fingerprint:
        raise UserError(
            f"checkpoint {path} was written with another optimizer ({saved_optimizer}; this run makes "
            f"{identity.optimizer_fingerprint}): its state cannot continue here. Resume with the same optimizer "
            "options, or start a new run (another --output-dir) from the checkpoint's model.safetensors."
        )
    check_strategy(accelerator, path)
    check_random_states(accelerator, path)
    if saved.get("checkpoint_format", 1) < 2:
        misplaced = misplaced_optimizer_state(path)
        if misplaced:
            raise UserError(
                f"checkpoint {path} was written by an earlier ddp-accel with --async-checkpoint under "
                f"fsdp_state_dict_type FULL_STATE_DICT, and its optimizer state is not its step's ({misplaced}): a "
                "resume from it would not continue the run. Resume from a checkpoint saved without "
                "--async-checkpoint, or start again (another --output-dir)."
            )
    warning = (
        compare_identity(saved.get("identity"), identity.identity, f"checkpoint {path}") if identity.identity else None
    )
    return saved, warning


def check_random_states(accelerator: Accelerator, path: Path) -> None:
    """Every rank's RNG states load as Accelerate's load_state will load them (`accelerate.utils.load`, which only
    logs a failure and goes on with other random streams: a resume that is not exact, silently); the ranks agree.
    numpy 1's unpickler cannot read numpy 2's arrays, for one."""
    from accelerate.utils import load

    rng = path / f"random_states_{accelerator.process_index}.pkl"
    problem = None
    if rng.is_file():
        try:
            load(rng)
        except Exception as error:
            problem = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    failed = accelerator.reduce(torch.tensor(float(problem is not None), device=accelerator.device), "sum")
    if failed.item():
        raise UserError(
            f"checkpoint {path}: this Accelerate cannot read its random states ({problem or 'on another process'}), "
            "so a resume would not continue it exactly; resume it under the libraries it was written with (numpy's "
            "major version among them), or start a new run from its model"
        )


def misplaced_optimizer_state(path: Path) -> str | None:
    """An FSDP FULL_STATE_DICT checkpoint (pytorch_model_fsdp.bin and optimizer.bin) whose optimizer state holds a
    tensor with exactly the bytes of one of the model's: what the asynchronous staging of earlier versions wrote
    when a gathered optimizer tensor reused the memory of a model tensor staged and freed before it. None when
    there is none (tensors of zeros and single values left out: they can be equal by chance)."""
    model_file, optimizer_file = path / (FSDP_MODEL_FOLDER.removesuffix("_0") + ".bin"), path / "optimizer.bin"
    if not (model_file.is_file() and optimizer_file.is_file()):
        return None

    def contents(tensor: torch.Tensor) -> bytes | None:
        if tensor.numel() < 2 or not tensor.any():
            return None
        return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    model = torch.load(model_file, map_location="cpu", weights_only=True)
    weights = {contents(tensor): name for name, tensor in model.items() if isinstance(tensor, torch.Tensor)}
    weights.pop(None, None)
    optimizer = torch.load(optimizer_file, map_location="cpu", weights_only=True)
    for parameter, values in optimizer.get("state", {}).items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and contents(value) in weights:
                return f"{key} of {parameter} holds the weights of {weights[contents(value)]}"
    return None


def load_sharded_model(model: torch.nn.Module, path: Path) -> None:
    """The model of an FSDP checkpoint (its shards in `pytorch_model_fsdp_0/`, torch.distributed.checkpoint) into
    the bare `model` on every rank, whole: what an evaluation needs, where no optimizer state is wanted. Every rank
    calls it."""
    import torch.distributed.checkpoint as dcp

    full = path / (FSDP_MODEL_FOLDER.removesuffix("_0") + ".bin")  # fsdp_state_dict_type FULL_STATE_DICT's file
    state = {"model": model.state_dict()}
    try:
        if full.is_file():
            state["model"] = torch.load(full, map_location="cpu", weights_only=True)
        else:
            dcp.load(state, checkpoint_id=str(path / FSDP_MODEL_FOLDER))
    except Exception as error:  # torch's CheckpointException lists each rank's failure
        raise UserError(f"cannot load checkpoint {path}: {str(error).strip().splitlines()[0]}") from None
    model.load_state_dict(state["model"])
