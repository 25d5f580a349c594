"""Run with torchrun --nproc_per_node 2: CPUSyncBatchNorm on half batches == BatchNorm2d on the whole batch."""

import torch
import torch.distributed as dist
from torch import nn

from ddp_accel.endings import shutdown
from ddp_accel.sync_bn import convert_sync_batchnorm


def main() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 5, 5, generator=generator) * 3 + 1
    # a channel whose mean is large against its spread: E[x^2] - E[x]^2 in float32 loses its variance's digits
    x[:, 2] = x[:, 2] * 0.05 + 30
    weights = torch.randn(8, 3, 5, 5, generator=generator)  # loss = sum(y * weights): a non-trivial gradient

    reference = nn.BatchNorm2d(3)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5, generator=generator)
        reference.bias.uniform_(-0.5, 0.5, generator=generator)
    synced, converted = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), torch.device("cpu"))
    synced[0].load_state_dict(reference.state_dict())
    assert converted == 1 and type(synced[0]).__name__ == "CPUSyncBatchNorm"

    full_x = x.clone().requires_grad_()
    full_y = reference(full_x)
    (full_y * weights).sum().backward()

    part = slice(rank * 8 // world, (rank + 1) * 8 // world)
    local_x = x[part].clone().requires_grad_()
    local_y = synced(local_x)
    (local_y * weights[part]).sum().backward()

    torch.testing.assert_close(local_y, full_y[part], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(local_x.grad, full_x.grad[part], atol=1e-5, rtol=1e-5)
    for name in ("weight", "bias"):
        grad = getattr(synced[0], name).grad.clone()
        dist.all_reduce(grad)  # the whole batch's gradient is the sum of the ranks' parts
        torch.testing.assert_close(grad, getattr(reference, name).grad, atol=1e-4, rtol=1e-5)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(synced[0], name), getattr(reference, name), atol=1e-5, rtol=1e-5)
    print(f"rank {rank}: sync batchnorm matches the full batch")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()
    # the autograd graphs and gloo work objects of main() are gone before the group goes: destroyed after it, at
    # interpreter exit, they aborted the process now and then (`terminate called without an active exception`)
    shutdown(clean=True)
