"""A rank of the ordered sum's chain (ddp_accel.exact_reduction.ProcessChain) in a group of 3 that meets at a store
its driver holds (tests/test_recovery.py): rank 1 is killed in the middle of sending its running total (400 MB) to
rank 2; each prints how its wait ended."""

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from ddp_accel.exact_reduction import ProcessChain


def main(rank: int) -> None:
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False)
    group_store = dist.PrefixStore("generation_0", store)
    dist.init_process_group("gloo", store=group_store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=20))
    chain, total = ProcessChain(), torch.ones(100_000_000)
    if rank:  # (one whole pass first: the pairs' groups formed)
        chain.receive(total, rank - 1)
    if rank < 2:
        chain.send(total, rank + 1)
    dist.barrier()
    started = time.time()
    try:
        if rank == 1:
            chain.receive(total, 0)
            threading.Timer(0.05, lambda: os.kill(os.getpid(), 9)).start()  # in the middle of the send
            chain.send(total, 2)
            time.sleep(30)
        elif rank == 0:
            chain.send(total, 1)
            chain.broadcast(total, 2)
        else:
            chain.receive(total, 1)
            chain.broadcast(total, 2)
        print(f"rank {rank}: done in {time.time() - started:.2f} s", flush=True)
    except Exception as error:
        print(f"rank {rank}: {type(error).__name__} after {time.time() - started:.2f} s: {error}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
