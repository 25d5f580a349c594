"""SyncBatchNorm that also runs on CPU processes (gloo), so `--sync-bn` means the same on a laptop and on GPUs.

torch's SyncBatchNorm refuses CPU tensors. On GPUs we use it as is; on CPU the layers become
`CPUSyncBatchNorm`, whose training forward gathers each rank's count, per-channel mean and sum of squared
deviations and combines them (Chan's parallel variance, as torch's CUDA kernels do), and whose backward
all-reduces the two per-channel gradient sums: the batch statistics of the global batch (up to float rounding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _per_channel(x: torch.Tensor) -> tuple[int, list[int], list[int]]:
    """Channels, the dimensions a per-channel sum reduces, and the shape that broadcasts a per-channel value."""
    channels = x.shape[1]
    return channels, [d for d in range(x.dim()) if d != 1], [1, channels] + [1] * (x.dim() - 2)


def _global_statistics(
    x: torch.Tensor, channels: int, dims: list[int], shape: list[int], group: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batch's per-channel mean and (biased) variance, and its count. Each rank's mean and sum of squared
    deviations from it, combined in rank order: E[x^2] - E[x]^2 would lose every digit of a channel whose mean is
    large against its spread, and the variance's error, through 1/sqrt(var + eps), grows a rounding difference
    between two runs into a different step."""
    local = x.numel() // channels
    mean = x.mean(dims) if local else x.new_zeros(channels)
    deviations = ((x - mean.view(shape)) ** 2).sum(dims) if local else x.new_zeros(channels)
    mine = torch.cat([x.new_tensor([float(local)]), mean, deviations])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    ranks = torch.stack(gathered)
    counts, means, squares = ranks[:, :1], ranks[:, 1 : channels + 1], ranks[:, channels + 1 :]
    count = counts.sum()
    global_mean = (counts * means).sum(0) / count
    variance = (squares.sum(0) + (counts * (means - global_mean) ** 2).sum(0)) / count
    return global_mean, variance, count


class _SyncBatchNormCPU(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: Any,
    ) -> torch.Tensor:
        channels, dims, shape = _per_channel(x)
        mean, var, count = _global_statistics(x, channels, dims, shape, group)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            running_var.mul_(1 - momentum).add_(momentum * var * count / max(count.item() - 1, 1))
        invstd = torch.rsqrt(var + eps)
        normalized = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(normalized, weight, invstd)
        ctx.group, ctx.count = group, count
        return normalized * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        normalized, weight, invstd = ctx.saved_tensors
        channels, dims, shape = _per_channel(grad_output)
        sum_dy, sum_dy_xhat = grad_output.sum(dims), (grad_output * normalized).sum(dims)
        # local weight/bias gradients: DDP averages them across ranks like any other parameter's
        grad_weight, grad_bias = sum_dy_xhat.clone(), sum_dy.clone()
        sums = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(sums, group=ctx.group)
        mean_dy, mean_dy_xhat = (sums[:channels] / ctx.count).view(shape), (sums[channels:] / ctx.count).view(shape)
        grad_input = (weight * invstd).view(shape) * (grad_output - mean_dy - normalized * mean_dy_xhat)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch for CPU processes (gloo). Not an nn.SyncBatchNorm subclass: DDP
    refuses any of those on CPU. Same parameters and buffers as BatchNorm, so checkpoints load either way."""

    process_group = None

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.process_group) if dist.is_available() and dist.is_initialized() else 1
        if not self.training or world == 1 or not self.affine:
            return super().forward(x)
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        # momentum None: a cumulative average, as in nn.BatchNorm
        momentum = 1.0 / float(self.num_batches_tracked or 1) if self.momentum is None else self.momentum
        return _SyncBatchNormCPU.apply(
            x,
            self.weight,
            self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps,
            momentum,
            self.process_group or dist.group.WORLD,
        )


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> tuple[nn.Module, int]:
    """BatchNorm*d -> SyncBatchNorm (CPUSyncBatchNorm on CPU). Returns the model and how many layers changed."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    layers = [module for module in model.modules() if isinstance(module, nn.SyncBatchNorm)]
    if device.type == "cpu":
        for module in layers:
            module.__class__ = CPUSyncBatchNorm  # type: ignore[assignment]
    return model, len(layers)
