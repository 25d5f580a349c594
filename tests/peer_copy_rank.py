"""A process of a group of 3 that meets at a store its driver holds (tests/test_recovery.py), around
ddp_accel.peer_copy.share: `whole`: ranks 0 and 1 hold the same copy (a checkpoint's nested states: dtypes a
backend cannot send as themselves, a tensor held twice, empty and 0-d tensors, a state dict's metadata), rank 2
none, and each prints what it holds after; `giver_lost`: rank 0 holds 400 MB and is killed in the middle of
giving its bytes, and each receiver prints how its wait ended."""

import collections
import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from ddp_accel.peer_copy import share


def a_copy(giver: int) -> tuple:
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(3, 4, generator=generator)
    model = collections.OrderedDict(
        weight=weight,
        tied=weight,
        half=torch.randn(5, generator=generator).to(torch.bfloat16),
        count=torch.tensor(7),
        empty=torch.empty(0, 2),
        mask=torch.tensor([True, False, True]),
    )
    model._metadata = {"": {"version": 2}}
    optimizer = {
        "state": {0: {"step": torch.tensor(3.0), "momentum_buffer": torch.randn(3, 4, generator=generator)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}],
    }
    return giver, {"model.safetensors": model, "optimizer.bin": optimizer}, {"scheduler.bin": b"\x00\x01small"}


def described(copy: tuple) -> str:
    giver, files, small = copy
    model, optimizer = files["model.safetensors"], files["optimizer.bin"]
    expected = a_copy(giver)[1]
    tensors = [(model[name], expected["model.safetensors"][name]) for name in model]
    state, expected_state = optimizer["state"][0], expected["optimizer.bin"]["state"][0]
    tensors += [(state[name], expected_state[name]) for name in state]
    same = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in tensors)
    return (
        f"from {giver}, bitwise {same}, tied {model['tied'] is model['weight']}, {type(model).__name__} "
        f"{model._metadata}, groups {optimizer['param_groups']}, small {small}"
    )


def main(rank: int, mode: str) -> None:
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False)
    group_store = dist.PrefixStore("generation_0", store)
    dist.init_process_group("gloo", store=group_store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=20))
    if mode == "whole":
        held = a_copy(rank) if rank < 2 else None
        result = share(held)
        print(f"rank {rank}: {described(result)}; its own {result is held}", flush=True)
        return
    dist.barrier()
    started = time.time()
    try:
        if rank == 0:
            broadcast = dist.broadcast

            def killed_in_the_middle(*args, **kwargs):  # (of its tensor's bytes)
                threading.Timer(0.05, lambda: os.kill(os.getpid(), 9)).start()
                return broadcast(*args, **kwargs)

            dist.broadcast = killed_in_the_middle
            share((0, {"model.safetensors": {"weight": torch.ones(100_000_000)}}, {}))
            time.sleep(30)
        share(None)
        print(f"rank {rank}: given after {time.time() - started:.2f} s", flush=True)
    except Exception as error:
        print(f"rank {rank}: {type(error).__name__} after {time.time() - started:.2f} s: {error}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
