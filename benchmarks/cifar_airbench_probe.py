"""Is the CIFAR-10 mini accuracy limited by the recipe or by the data? A standalone probe, outside the project's
training loop: Keller Jordan's airbench94 recipe (a 2x2 patch-whitened stem, three conv-pool-BN-GELU groups of
widths 64/256/256, BatchNorm with bias only and a 64x larger bias learning rate, Nesterov SGD, label smoothing
0.2, a triangular schedule, flip + 1-pixel translation test-time augmentation), on the images decoded once into
memory, so that no pipeline cost hides what the recipe reaches.

    python benchmarks/cifar_airbench_probe.py cifar10_mini --epochs 30 --translate 4 --cutout 12

DATA_DIR holds train/<class>/*.jpg and val/<class>/*.jpg. Prints the held-out top-1 every 10 epochs and one
JSON line at the end; results in docs/imagenet.md. bf16 autocast unless --fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)


def load_split(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    classes = sorted(path.name for path in folder.iterdir() if path.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted((folder / name).iterdir()):
            images.append(np.asarray(Image.open(file).convert("RGB")))
            labels.append(label)
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (CIFAR_MEAN, CIFAR_STD))
    return (pixels - mean) / std, torch.tensor(labels)


class BiasOnlyBatchNorm(nn.BatchNorm2d):
    def __init__(self, channels: int):
        super().__init__(channels, eps=1e-12, momentum=0.4)
        self.weight.requires_grad = False


class DiracConv(nn.Conv2d):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(in_channels, out_channels, 3, padding="same", bias=False)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.dirac_(self.weight.data[: self.weight.size(1)])  # starts near the identity


class ConvGroup(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1, self.norm1 = DiracConv(in_channels, out_channels), BiasOnlyBatchNorm(out_channels)
        self.conv2, self.norm2 = DiracConv(out_channels, out_channels), BiasOnlyBatchNorm(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(F.max_pool2d(self.conv1(x), 2)))
        return F.gelu(self.norm2(self.conv2(x)))


def make_net(widths: tuple[int, int, int], train_images: torch.Tensor) -> nn.Sequential:
    whiten = nn.Conv2d(3, 24, 2, bias=True)
    with torch.no_grad():  # the 2x2 patches' covariance eigenvectors, scaled to unit variance, and their negatives
        patches = train_images[:5000].unfold(2, 2, 1).unfold(3, 2, 1).transpose(1, 3).reshape(-1, 12)
        eigenvalues, eigenvectors = torch.linalg.eigh(patches.T @ patches / len(patches))
        filters = eigenvectors.T.reshape(12, 3, 2, 2).flip(0) / torch.sqrt(eigenvalues.flip(0) + 5e-4).view(-1, 1, 1, 1)
        whiten.weight.copy_(torch.cat((filters, -filters)))
    whiten.weight.requires_grad = False
    w1, w2, w3 = widths
    return nn.Sequential(
        whiten,
        nn.GELU(),
        ConvGroup(24, w1),
        ConvGroup(w1, w2),
        ConvGroup(w2, w3),
        nn.MaxPool2d(3),
        nn.Flatten(),
        nn.Linear(w3, 10, bias=False),
    )


def evaluate(net: nn.Module, images: torch.Tensor, labels: torch.Tensor, bf16: bool) -> float:
    """Top-1 with flip + 1-pixel translation test-time augmentation (airbench's level 2)."""
    net.eval()
    correct = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for start in range(0, len(images), 1000):
            x = images[start : start + 1000].contiguous(memory_format=torch.channels_last)
            logits = net(x).float() + net(x.flip(3)).float()
            padded = F.pad(x, (1,) * 4, "reflect")
            for shifted in (padded[:, :, :32, :32], padded[:, :, 2:, 2:]):
                logits += 0.5 * (net(shifted).float() + net(shifted.flip(3)).float())
            correct += (logits.argmax(1) == labels[start : start + 1000]).sum().item()
    net.train()
    return correct / len(images)


def augment(batch: torch.Tensor, translate: int, cutout: int, generator: torch.Generator) -> torch.Tensor:
    """Random translation (reflect padding), flip and cutout, per image."""
    n = len(batch)
    if translate:
        padded = F.pad(batch, (translate,) * 4, "reflect")
        shifts = torch.randint(0, 2 * translate + 1, (2, n), generator=generator)
        batch = torch.stack([padded[i, :, y : y + 32, x : x + 32] for i, (y, x) in enumerate(shifts.T.tolist())])
    flip = torch.rand(n, generator=generator) < 0.5
    batch = torch.where(flip.view(-1, 1, 1, 1), batch.flip(3), batch)
    if cutout:
        centres = torch.randint(0, 32, (2, n), generator=generator)
        grid = torch.arange(32)
        rows = (grid.view(1, -1) - centres[0].view(-1, 1)).abs() <= cutout // 2
        cols = (grid.view(1, -1) - centres[1].view(-1, 1)).abs() <= cutout // 2
        batch = batch * ~(rows.view(n, 1, 32, 1) & cols.view(n, 1, 1, 32))
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="DATA_DIR with train/ and val/")
    parser.add_argument("--epochs", type=float, default=40)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--widths", type=int, nargs=3, default=[64, 256, 256])
    parser.add_argument("--translate", type=int, default=2, help="pixels of random translation")
    parser.add_argument("--cutout", type=int, default=0, help="side of the square zeroed; 0: none")
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    train_images, train_labels = load_split(Path(args.data) / "train")
    val_images, val_labels = load_split(Path(args.data) / "val")
    net = make_net(tuple(args.widths), train_images).to(memory_format=torch.channels_last)
    # airbench's hyper-parameters are for a summed loss; these are the same steps for the mean loss
    momentum, label_smoothing, bias_scale = 0.85, 0.2, 64.0
    lr = 11.5 / (1 + 1 / (1 - momentum))
    decay = 0.0153 / (args.batch_size * (1 + 1 / (1 - momentum)))
    biases = [p for name, p in net.named_parameters() if p.requires_grad and (".norm" in name or name == "0.bias")]
    others = [p for p in net.parameters() if p.requires_grad and all(p is not b for b in biases)]
    optimizer = torch.optim.SGD(
        [
            dict(params=biases, lr=lr * bias_scale, weight_decay=decay / bias_scale),
            dict(params=others, lr=lr, weight_decay=decay),
        ],
        momentum=momentum,
        nesterov=True,
    )
    initial = [group["lr"] for group in optimizer.param_groups]
    steps_per_epoch = len(train_images) // args.batch_size
    total = math.ceil(args.epochs * steps_per_epoch)

    def triangle(step: int) -> float:  # 0.2 -> 1 over the first 23%, then down to 0.07
        share = step / total
        return 0.2 + 0.8 * share / 0.23 if share < 0.23 else 1 - 0.93 * (share - 0.23) / 0.77

    generator = torch.Generator().manual_seed(args.seed)
    started, step, history = time.time(), 0, []
    while step < total:
        order = torch.randperm(len(train_images), generator=generator)
        for start in range(0, steps_per_epoch * args.batch_size, args.batch_size):
            if step >= total:
                break
            index = order[start : start + args.batch_size]
            batch = augment(train_images[index], args.translate, args.cutout, generator)
            for group, lr0 in zip(optimizer.param_groups, initial, strict=True):
                group["lr"] = lr0 * triangle(step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
                logits = net(batch.contiguous(memory_format=torch.channels_last)).float() / 9
            loss = F.cross_entropy(logits, train_labels[index], label_smoothing=label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
        epoch = step / steps_per_epoch
        if step >= total or int(epoch) % 10 == 0:
            top1 = evaluate(net, val_images, val_labels, not args.fp32)
            history.append({"epoch": round(epoch, 1), "val_top1": top1, "seconds": round(time.time() - started)})
            print(f"epoch {epoch:.1f}: held-out top-1 {top1:.4f}, {time.time() - started:.0f} s", flush=True)
    print(json.dumps({"options": vars(args), "history": history}))


if __name__ == "__main__":
    main()
