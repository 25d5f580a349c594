"""A copy one process holds, given over its group to the processes that lack it, bitwise.

Under `ddp-accel launch --recover in-process` the survivors of a loss each hold the step they reached in memory
(ddp_accel.checkpoint_format.hold). A replacement that joins them is given the copy of the first of them instead of
reading the step's files (one survivor may still be writing them; on a shared file system a read of every byte):
its structure and small values pickled once, then each tensor as its bytes (whatever its dtype), over a group of
the giver and the processes that lack it. Every wait reads the launcher's word: a giver lost mid-message ends the
receiver's wait (a lost peer's error) instead of gloo's timeout.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from ddp_accel.exact_reduction import wait_watching_the_launcher


class Slot:
    """Where a tensor stood in a copy's structure: its index among the copy's tensors."""

    def __init__(self, index: int):
        self.index = index


def take_apart(obj: Any, tensors: list[torch.Tensor], seen: dict[int, int]) -> Any:
    """`obj` with each tensor replaced by its Slot (appended to `tensors`; one tensor held twice, one slot)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen[id(obj)] = len(tensors)
            tensors.append(obj.detach().resolve_conj().resolve_neg().contiguous())
        return Slot(seen[id(obj)])
    if isinstance(obj, dict):
        apart = copy.copy(obj)  # (its own type and attributes kept: a state dict's _metadata)
        for key, value in obj.items():
            apart[key] = take_apart(value, tensors, seen)
        return apart
    if isinstance(obj, list | tuple):
        return rebuilt(obj, [take_apart(value, tensors, seen) for value in obj])
    return obj


def put_together(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`take_apart` undone."""
    if isinstance(obj, Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        whole = copy.copy(obj)
        for key, value in obj.items():
            whole[key] = put_together(value, tensors)
        return whole
    if isinstance(obj, list | tuple):
        return rebuilt(obj, [put_together(value, tensors) for value in obj])
    return obj


def rebuilt(obj: list[Any] | tuple[Any, ...], parts: list[Any]) -> Any:
    """A list or tuple like `obj` of `parts` (a named tuple's fields as its arguments)."""
    if isinstance(obj, list):
        return parts
    return type(obj)(*parts) if hasattr(type(obj), "_fields") else type(obj)(parts)


def cloned(obj: Any) -> Any:
    """`obj` with each tensor copied (a tensor held twice: one copy)."""
    tensors: list[torch.Tensor] = []
    structure = take_apart(obj, tensors, {})
    return put_together(structure, [tensor.clone() for tensor in tensors])


def share(held: Any) -> Any:
    """Every process of the default group at the same point: `held`, the copy this process holds, or None.
    Returns the copy each process then holds: its own, or the first holder's, given to it (None where no process
    holds one: each reads what it needs elsewhere)."""
    if not dist.is_initialized():  # (no group: no peer)
        return held
    holds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(holds, held is not None)
    if all(holds) or not any(holds):
        return held
    giver = holds.index(True)
    ranks = [giver, *(rank for rank, has in enumerate(holds) if not has)]
    group = dist.new_group(ranks, backend="gloo")  # (every process of the group makes it; the copies are on the CPU)
    if not isinstance(group, dist.ProcessGroup):  # (a process outside it)
        return held
    tensors: list[torch.Tensor] = []
    header = [(take_apart(held, tensors, {}), [(tensor.shape, tensor.dtype) for tensor in tensors])]
    dist.broadcast_object_list(header, src=giver, group=group)
    structure, layout = header[0]
    if held is None:
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in layout]
    for tensor in tensors:
        if tensor.numel():  # its bytes: any dtype a backend cannot send as itself
            wait_watching_the_launcher(dist.broadcast(tensor.view(-1).view(torch.uint8), giver, group, async_op=True))
    return held if held is not None else put_together(structure, tensors)
