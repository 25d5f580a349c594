"""DDP communication hooks (`--ddp-comm-hook`): how the gradients of a step travel between the ranks.

- `fp16`, `bf16`: each gradient bucket is cast to 16 bits for the all-reduce and back (half the bytes);
- `powersgd`: after `--powersgd-start-step` plain steps, each bucket's gradient matrix is sent as two rank-r factors
  (`--powersgd-rank`), with error feedback: what the compression dropped is added to the next step's gradient.

Accelerate registers fp16/bf16 (`DistributedDataParallelKwargs(comm_hook=...)`); ddp_accel registers PowerSGD
after `prepare` (`register_powersgd`) and keeps its per-rank state (the error feedback, the warm-started factors,
its step count and random generator) in each checkpoint, one file per rank, so that a resume continues the same
compression bitwise.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_accel.errors import UserError

STATE_FILE = "comm_hook_state_{rank}.pt"


@dataclass(frozen=True)
class DdpOptions:
    """How DDP wraps the model: the hook, PowerSGD's rank and start, and whether parameters may go unused."""

    comm_hook: str = "none"
    powersgd_rank: int = 0  # (with --ddp-comm-hook powersgd: the options', by default config.POWERSGD_DEFAULTS)
    powersgd_start_step: int = 0
    find_unused_parameters: bool = False

    def describe(self, total_steps: int | None = None, keepers: list[PowerSGD] | None = None) -> str | None:
        """The banner's line (with the run's length and its PowerSGD keeper: whether it ever compresses)."""
        compressed = keepers[0].compressed() if keepers else -1
        return describe(self.comm_hook, self.powersgd_rank, self.powersgd_start_step, total_steps, compressed)


PLAIN_DDP = DdpOptions()


# PowerSGD's all-reduces are issued from the callbacks of each bucket's future; over gloo those run on several
# threads, so with two buckets or more the ranks issued them in different orders and hung (MLP-2048 on 2 CPU
# processes, every run). One bucket over gloo: nothing to order.
ONE_BUCKET_MB = 1_000_000


def ddp_kwargs(options: DdpOptions, gloo: bool = False) -> Any:
    """Accelerate's DDP options with the fp16/bf16 hook asked for (PowerSGD is registered after prepare; over
    `gloo` it gets one gradient bucket)."""
    from accelerate import DistributedDataParallelKwargs
    from accelerate.utils import DDPCommunicationHookType

    kinds = {
        "none": DDPCommunicationHookType.NO,
        "fp16": DDPCommunicationHookType.FP16,
        "bf16": DDPCommunicationHookType.BF16,
        "powersgd": DDPCommunicationHookType.NO,  # registered by register_powersgd after prepare
    }
    one_bucket = gloo and options.comm_hook == "powersgd"
    return DistributedDataParallelKwargs(
        find_unused_parameters=options.find_unused_parameters,
        bucket_cap_mb=ONE_BUCKET_MB if one_bucket else 25,
        comm_hook=kinds[options.comm_hook],
    )


def check_hook(hook: str, distributed_type: str, processes: int) -> None:
    """A hook acts on DDP's all-reduce: with one process there is none, and FSDP reduce-scatters its shards."""
    if hook == "none":
        return
    if distributed_type in ("FSDP", "DEEPSPEED"):
        raise UserError(f"--ddp-comm-hook {hook} compresses DDP's all-reduce: {distributed_type} does not use it")
    if processes == 1:
        raise UserError(f"--ddp-comm-hook {hook}: one process communicates nothing; launch several, or drop it")


def check_model(model: Any, hook: str) -> None:
    """torch's hooks compress dense gradient buckets: a model with sparse gradients (an embedding with
    sparse=True, imdb.py's bag) is one line."""
    if hook != "none" and any(getattr(module, "sparse", False) is True for module in model.modules()):
        raise UserError(
            f"--ddp-comm-hook {hook} compresses dense gradients, and this model has sparse ones (an embedding with "
            "sparse=True; imdb.py: --sparse off)"
        )


def describe(
    hook: str, powersgd_rank: int, powersgd_start_step: int, total_steps: int | None = None, compressed: int = -1
) -> str | None:
    """The banner's line; None without a hook. With the run's `total_steps` and the number of matrices PowerSGD
    `compressed` at its rank, a PowerSGD that would compress nothing says so."""
    if hook == "powersgd":
        line = f"PowerSGD rank {powersgd_rank} from step {powersgd_start_step + 1}"
        if total_steps is not None and powersgd_start_step >= total_steps:
            return f"{line}: never, in this run's {total_steps} steps (every step a plain all-reduce)"
        if compressed == 0:
            return f"{line}: no matrix of the model is larger than that rank (every step a plain all-reduce)"
        return f"{line}, error feedback kept in checkpoints"
    if hook in ("fp16", "bf16"):
        return f"{hook} compression of the gradients' all-reduce (half the bytes)"
    return None


class PowerSGD:
    """torch's PowerSGD hook on a DDP model, with its state kept by parameter for checkpoints.

    PowerSGD's state (the error feedback, the warm-started factors P and Q) is laid out per gradient bucket, in the
    bucket's order of parameters. DDP lays its buckets out again after its first step (in the order the gradients
    became ready), so a resumed process starts with another layout than the one the state was saved in. So the
    state is saved by parameter name, and laid out again for each bucket the first time the hook sees it, and
    whenever DDP changes a bucket's layout: the compression's results do not depend on the layout (each matrix is
    compressed alone, the sums are elementwise), so a resume continues bitwise."""

    def __init__(self, model: Any, rank: int, start_step: int):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self.state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start_step)
        self.names = {id(parameter): name for name, parameter in model.module.named_parameters()}
        self.shapes = {name: tuple(parameter.shape) for name, parameter in model.module.named_parameters()}
        self.layouts: dict[int, list[str]] = {}  # bucket index -> its parameters, in order
        self.pending: dict[str, dict[str, Any]] | None = None  # by parameter, waiting for its bucket's layout
        # DDP accepts a hook whose `bucket` is not annotated, or annotated with dist.GradBucket itself (this module's
        # annotations are strings)
        PowerSGD._hook.__annotations__.clear()
        model.register_comm_hook(self, PowerSGD._hook)
        # DDP lays its buckets out again after a process's first step, in the order the gradients became ready: a
        # resumed process then compressed its first step in the first layout, where the uninterrupted run had the
        # second, and the matrix products round differently where a gradient lies elsewhere (1e-8 apart, measured).
        # Told now that every parameter is ready (DDP's Join does so for a rank out of data), DDP lays them out
        # again in their own order, the first step's: one layout for every step of every process
        with contextlib.suppress(AttributeError):  # a private method of torch's DDP reducer (torch 2.14)
            model.reducer._push_all_rebuilt_params()

    @staticmethod
    def _hook(self: PowerSGD, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        index, layout = bucket.index(), [self.names[id(parameter)] for parameter in bucket.parameters()]
        if self.layouts.get(index, layout) != layout:  # DDP laid its buckets out again
            self.pending = {**(self.pending or {}), **self._by_parameter()}
            self.layouts.clear()
        self.layouts[index] = layout
        if self.pending:
            self._lay_out(index, layout, bucket.buffer().device)
        return powerSGD_hook.powerSGD_hook(self.state, bucket)

    def _slices(self, layout: list[str]) -> dict[str, dict[str, slice]]:
        """Where each parameter of a bucket lies in its error feedback, its Ps and its Qs (torch's order: the
        compressed matrices grouped by shape, in the order each shape first comes)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        slices: dict[str, dict[str, slice]] = {}
        offset, by_shape = 0, dict[tuple[int, int], list[tuple[str, int]]]()
        for name in layout:
            shape = self.shapes[name]
            rows, numel = shape[0] if shape else 1, math.prod(shape)
            columns = numel // rows if rows else 0
            slices[name] = {"error": slice(offset, offset + numel)}
            offset += numel
            rank = min(rows, columns, self.state.matrix_approximation_rank)
            if _should_compress(rows, columns, rank, self.state.min_compression_rate)[0]:
                by_shape.setdefault((rows, columns), []).append((name, rank))
        p_offset = q_offset = 0
        for (rows, columns), members in by_shape.items():
            for name, rank in members:
                slices[name]["p"] = slice(p_offset, p_offset + rows * rank)
                slices[name]["q"] = slice(q_offset, q_offset + columns * rank)
                p_offset, q_offset = p_offset + rows * rank, q_offset + columns * rank
        return slices

    def _by_parameter(self) -> dict[str, dict[str, Any]]:
        """The buckets' state cut into each parameter's pieces."""
        memories = {"error": self.state.error_dict, "p": self.state.p_memory_dict, "q": self.state.q_memory_dict}
        pieces: dict[str, dict[str, Any]] = {}
        for index, layout in self.layouts.items():
            for name, where in self._slices(layout).items():
                for kind, place in where.items():
                    if index in memories[kind]:
                        pieces.setdefault(name, {})[kind] = memories[kind][index][place].clone()
        for memory in memories.values():
            memory.clear()
        return pieces

    def _lay_out(self, index: int, layout: list[str], device: Any) -> None:
        """Bucket `index`'s state from the pending pieces of its parameters (a memory is set only when every
        parameter has its piece: otherwise PowerSGD starts that part afresh, as torch does)."""
        import torch

        assert self.pending is not None
        slices = self._slices(layout)
        memories = {"error": self.state.error_dict, "p": self.state.p_memory_dict, "q": self.state.q_memory_dict}
        for kind, memory in memories.items():
            wanted = sorted(((where[kind], name) for name, where in slices.items() if kind in where), key=_start)
            pieces = [self.pending.get(name, {}).get(kind) for _, name in wanted]
            sizes = [place.stop - place.start for place, _ in wanted]
            fits = all(piece is not None and piece.numel() == size for piece, size in zip(pieces, sizes, strict=True))
            if wanted and fits:
                memory[index] = torch.cat([piece for piece in pieces if piece is not None]).to(device)
        for name in layout:
            self.pending.pop(name, None)

    def compressed(self) -> int:
        """How many of the model's matrices PowerSGD compresses at its rank (torch compresses a matrix only where
        the factors are smaller than it)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        count, state = 0, self.state
        for shape in self.shapes.values():
            rows, numel = shape[0] if shape else 1, math.prod(shape)
            columns = numel // rows if rows else 0
            rank = min(rows, columns, state.matrix_approximation_rank)
            count += bool(len(shape) > 1 and _should_compress(rows, columns, rank, state.min_compression_rate)[0])
        return count

    def state_dict(self) -> dict[str, Any]:
        slots = ("iter", "rng", "matrix_approximation_rank", "start_powerSGD_iter")
        kept = {slot: getattr(self.state, slot) for slot in slots}
        return {**kept, "by_parameter": {**(self.pending or {}), **self._pieces_now()}}

    def _pieces_now(self) -> dict[str, dict[str, Any]]:
        """What `_by_parameter` gives, without clearing the buckets' state (a save during training)."""
        saved = (dict(self.state.error_dict), dict(self.state.p_memory_dict), dict(self.state.q_memory_dict))
        pieces = self._by_parameter()
        self.state.error_dict.update(saved[0])
        self.state.p_memory_dict.update(saved[1])
        self.state.q_memory_dict.update(saved[2])
        return pieces

    def load_state_dict(self, values: dict[str, Any], feedback: bool = True) -> list[str]:
        """The step count and random generator (the same on every rank); with `feedback`, this rank's error
        feedback, and its factors where they were made at this rank of approximation. Returns what a change of
        rank or start step at the resume drops (one line each)."""
        state, notes = self.state, []
        state.iter, state.rng = values["iter"], values["rng"]
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.clear()
        saved_rank, saved_start = values.get("matrix_approximation_rank"), values.get("start_powerSGD_iter")
        same_rank = saved_rank == state.matrix_approximation_rank
        if feedback and not same_rank and values["by_parameter"]:
            notes.append(f"PowerSGD's rank {saved_rank} -> {state.matrix_approximation_rank}: its factors start afresh")
        # compressing at the checkpoint, and not any more until a later start: its error feedback would be stale then
        off_again = saved_start is not None and saved_start <= state.iter < state.start_powerSGD_iter
        if feedback and off_again and values["by_parameter"] and saved_start is not None:
            notes.append(
                f"PowerSGD compressed from step {saved_start + 1}; now off until step {state.start_powerSGD_iter + 1}, "
                "and its error feedback starts afresh then"
            )
            feedback = False
        pieces = values["by_parameter"] if feedback else {}
        self.pending = {
            name: {kind: piece for kind, piece in kinds.items() if kind == "error" or same_rank}
            for name, kinds in pieces.items()
        } or None
        return notes


def register_powersgd(model: Any, options: DdpOptions) -> list[PowerSGD]:
    """PowerSGD on the prepared DDP `model` when asked for (Accelerate is told no hook then): [its keeper]."""
    from torch.nn.parallel import DistributedDataParallel

    if options.comm_hook != "powersgd" or not isinstance(model, DistributedDataParallel):
        return []
    return [PowerSGD(model, options.powersgd_rank, options.powersgd_start_step)]


class PowerSGDStates:
    """Each rank's PowerSGD state in a checkpoint (a component of ddp_accel.checkpoint_format): its own file per
    rank. Registered in every run: a checkpoint's state that this run does not compress with is said."""

    name = "PowerSGD"

    def __init__(self, keepers: list[PowerSGD]):
        self.keepers = keepers

    @property
    def each_rank(self) -> str | None:
        return "PowerSGD's error feedback is each rank's own" if self.keepers else None

    def save(self, folder: Path, rank: int, ranks: int, save: Callable[[Any, Path], None]) -> None:
        save_states(self.keepers, folder, rank, ranks, save)

    def load(self, folder: Path, rank: int, ranks: int) -> list[str]:
        note = load_states(self.keepers, folder, rank, ranks)
        return [note] if note else []


def save_states(
    keepers: list[PowerSGD], folder: Path, rank: int, world_size: int, save: Callable[[Any, Path], None] | None = None
) -> None:
    """Each rank's PowerSGD state into `folder` (every rank calls it; nothing without PowerSGD), by `save`
    (torch.save, or an asynchronous checkpoint's staging)."""
    import torch

    if keepers:
        saved = {"world_size": world_size, "states": [keeper.state_dict() for keeper in keepers]}
        (save or torch.save)(saved, folder / STATE_FILE.format(rank=rank))


def load_states(keepers: list[PowerSGD], folder: Path, rank: int, world_size: int) -> str | None:
    """Each rank's PowerSGD state from `folder`. On another world size every rank takes the step count and the
    random generator of rank 0's file (the same on every rank: all ranks compress from the same step, with the same
    random factors) and starts its error feedback afresh (each rank's is for its own gradients); a note then."""
    import torch

    first = folder / STATE_FILE.format(rank=0)
    if not keepers:
        return (
            "PowerSGD's state in the checkpoint (its error feedback) is left unused: this run does not compress "
            "with PowerSGD"
            if first.is_file()
            else None
        )
    if not first.is_file():
        return "PowerSGD starts afresh: the checkpoint holds no state of it (saved without --ddp-comm-hook powersgd)"
    saved = torch.load(first, map_location="cpu", weights_only=False)  # numpy's random generator among them
    same_world = saved["world_size"] == world_size and len(saved["states"]) == len(keepers)
    if same_world and rank:
        saved = torch.load(folder / STATE_FILE.format(rank=rank), map_location="cpu", weights_only=False)
    notes = [
        note
        for keeper, values in zip(keepers, saved["states"], strict=False)
        for note in keeper.load_state_dict(values, feedback=same_world)
    ]
    if not same_world:
        notes.append(
            f"PowerSGD's error feedback starts afresh (its step count goes on): it was saved by "
            f"{saved['world_size']} processes, each for its own gradients, and {world_size} run now"
        )
    return "; ".join(notes) or None


def _start(item: tuple[slice, str]) -> int:
    return item[0].start
